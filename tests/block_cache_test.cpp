// The PyTorch plug-in's caching allocator (torch_plugin/block_cache.h) on the
// host: leases are malloc'd buffers (or bare address ranges where only the
// arithmetic matters), streams and events are fakes whose completion the test
// decides. Covers reuse on one stream without events, no reuse across streams
// before the event that covers the free completed, record_stream, the
// budget's error message, a source's refusal and failure, graph capture,
// splitting and merging, statistics, trim from another thread while
// allocations go on, and a randomized run checked against the invariants.
#include "torch_plugin/block_cache.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>
#include <vector>

namespace leasehold::torch_plugin {
namespace {

constexpr uint64_t kKiB = 1ull << 10;
constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kGiB = 1ull << 30;
constexpr StreamId kS1 = 0x1000, kS2 = 0x2000, kS3 = 0x3000;

// Leases: malloc'd buffers, or (virtual) address ranges never touched. A
// capacity makes it refuse like a full pool; `lost` makes it fail like a
// lost session.
class FakeLeases : public LeaseSource {
 public:
  explicit FakeLeases(bool virtual_memory = false) : virtual_(virtual_memory) {}
  ~FakeLeases() override {
    for (auto& [id, l] : leases_) {
      if (!virtual_) std::free(l.base);
    }
  }
  Result acquire(uint64_t bytes, bool last_resort, Lease* lease, std::string* why) override {
    std::lock_guard lk(mu_);
    ++acquires_;
    if (last_resort) ++last_resorts_;
    if (lost_) {
      *why = "the session is lost";
      return Result::kFailed;
    }
    if (capacity_ && leased_ + bytes > capacity_) {
      *why = "the pool is full";
      return Result::kRefused;
    }
    void* base;
    if (virtual_) {
      base = reinterpret_cast<void*>(next_addr_);
      next_addr_ += bytes + 64 * kMiB;  // a gap: neighbouring leases never touch
    } else {
      base = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
      if (!base) return Result::kFailed;
    }
    uint64_t id = next_id_++;
    leases_[id] = {base, bytes, id};
    leased_ += bytes;
    *lease = leases_[id];
    return Result::kGranted;
  }
  void release(uint64_t id) noexcept override {
    std::lock_guard lk(mu_);
    auto it = leases_.find(id);
    if (it == leases_.end()) {
      ++bad_releases_;
      return;
    }
    leased_ -= it->second.size;
    if (!virtual_) std::free(it->second.base);
    leases_.erase(it);
    ++releases_;
  }
  void set_capacity(uint64_t c) {
    std::lock_guard lk(mu_);
    capacity_ = c;
  }
  void set_lost() {
    std::lock_guard lk(mu_);
    lost_ = true;
  }
  uint64_t leased() {
    std::lock_guard lk(mu_);
    return leased_;
  }
  int acquires() {
    std::lock_guard lk(mu_);
    return acquires_;
  }
  int releases() {
    std::lock_guard lk(mu_);
    return releases_;
  }
  int last_resorts() {
    std::lock_guard lk(mu_);
    return last_resorts_;
  }
  int bad_releases() {
    std::lock_guard lk(mu_);
    return bad_releases_;
  }

 private:
  std::mutex mu_;
  bool virtual_;
  std::map<uint64_t, Lease> leases_;
  uint64_t next_id_ = 1, leased_ = 0, capacity_ = 0;
  uintptr_t next_addr_ = 0x7f0000000000;
  bool lost_ = false;
  int acquires_ = 0, releases_ = 0, last_resorts_ = 0, bad_releases_ = 0;
};

// Leases whose pages are real memory shown in a window, as the plug-in's
// are (lh_window_*): `pages` pages of `page` bytes in a memfd stand for the
// pool, and a lease is a run of the window's addresses whose pages show
// any free pages of it. unback() hides pages and frees them for the next
// lease, so what the source holds is what the cache's segments show.
class PagedLeases : public LeaseSource {
 public:
  PagedLeases(uint64_t page, uint64_t pages) : page_(page), free_(pages), va_(4 * pages, false) {
    fd_ = memfd_create("paged-leases", MFD_CLOEXEC);
    if (fd_ < 0 || ftruncate(fd_, static_cast<off_t>(page * pages)) != 0) std::abort();
    void* w = mmap(nullptr, page * va_.size(), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (w == MAP_FAILED) std::abort();
    window_ = static_cast<std::byte*>(w);
    for (uint64_t i = 0; i < pages; ++i) free_[i] = pages - 1 - i;
  }
  ~PagedLeases() override {
    munmap(window_, page_ * va_.size());
    close(fd_);
  }
  Result acquire(uint64_t bytes, bool, Lease* lease, std::string* why) override {
    std::lock_guard lk(mu_);
    const uint64_t n = bytes / page_;
    if (bytes % page_ != 0 || n == 0) {
      *why = "not whole pages";
      return Result::kFailed;
    }
    if (n > free_.size()) {
      *why = "the pool is full";
      return Result::kRefused;
    }
    uint64_t first = 0, run = 0;
    for (uint64_t i = 0; i < va_.size() && run < n; ++i) {
      run = va_[i] ? 0 : run + 1;
      if (run == 1) first = i;
    }
    if (run < n) {
      *why = "the window is full";
      return Result::kRefused;
    }
    Seg seg{first, std::vector<int64_t>(n)};
    for (uint64_t k = 0; k < n; ++k) {
      seg.phys[k] = static_cast<int64_t>(free_.back());
      free_.pop_back();
      va_[first + k] = true;
      show(first + k, static_cast<uint64_t>(seg.phys[k]));
    }
    const uint64_t id = next_id_++;
    segs_[id] = seg;
    *lease = {window_ + first * page_, bytes, id};
    return Result::kGranted;
  }
  void release(uint64_t id) noexcept override {
    std::lock_guard lk(mu_);
    auto it = segs_.find(id);
    if (it == segs_.end()) {
      ++bad_calls_;
      return;
    }
    hide_range(it->second, 0, it->second.phys.size());
    for (uint64_t k = 0; k < it->second.phys.size(); ++k) va_[it->second.first + k] = false;
    segs_.erase(it);
  }
  uint64_t page_size() const override { return page_; }
  void unback(uint64_t id, uint64_t offset, uint64_t bytes) noexcept override {
    std::lock_guard lk(mu_);
    auto it = segs_.find(id);
    if (it == segs_.end() || offset % page_ || bytes % page_ ||
        (offset + bytes) / page_ > it->second.phys.size()) {
      ++bad_calls_;
      return;
    }
    for (uint64_t k = offset / page_; k < (offset + bytes) / page_; ++k) {
      if (it->second.phys[k] < 0) ++bad_calls_;  // unbacked twice
    }
    hide_range(it->second, offset / page_, bytes / page_);
    ++unbacks_;
  }
  // Pages showing memory now (the pool's pages in use).
  uint64_t shown_bytes() {
    std::lock_guard lk(mu_);
    uint64_t n = 0;
    for (auto& [id, seg] : segs_) {
      for (int64_t p : seg.phys) n += p >= 0;
    }
    return n * page_;
  }
  int bad_calls() {
    std::lock_guard lk(mu_);
    return bad_calls_;
  }
  int unbacks() {
    std::lock_guard lk(mu_);
    return unbacks_;
  }

 private:
  struct Seg {
    uint64_t first;
    std::vector<int64_t> phys;  // per page: the memfd page it shows, -1: none
  };
  void show(uint64_t va_page, uint64_t phys) {
    if (mmap(window_ + va_page * page_, page_, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd_,
             static_cast<off_t>(phys * page_)) == MAP_FAILED) {
      std::abort();
    }
  }
  void hide_range(Seg& seg, uint64_t first, uint64_t count) {
    for (uint64_t k = first; k < first + count; ++k) {
      if (seg.phys[k] < 0) continue;
      if (mmap(window_ + (seg.first + k) * page_, page_, PROT_NONE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
        std::abort();
      }
      free_.push_back(static_cast<uint64_t>(seg.phys[k]));
      seg.phys[k] = -1;
    }
  }

  std::mutex mu_;
  const uint64_t page_;
  int fd_ = -1;
  std::byte* window_ = nullptr;
  std::vector<uint64_t> free_;  // free memfd pages
  std::vector<bool> va_;        // window pages in some lease
  std::map<uint64_t, Seg> segs_;
  uint64_t next_id_ = 1;
  int bad_calls_ = 0, unbacks_ = 0;
};

// Streams whose work completes when the test says so (complete(s): every
// event recorded on s so far), or at once in auto mode. wait() stands for
// the device finishing the stream's work up to the event.
class FakeStreams : public StreamOps {
 public:
  EventId record(StreamId s) override {
    std::lock_guard lk(mu_);
    if (fail_records_) throw std::runtime_error("fake: record failed");
    EventId e = next_event_++;
    events_[e] = {s, ++recorded_[s]};
    ++records_;
    return e;
  }
  bool query(EventId e) override {
    std::lock_guard lk(mu_);
    ++queries_;
    auto it = events_.find(e);
    if (it == events_.end()) throw std::logic_error("fake: query of an unknown event");
    return auto_ || it->second.ticket <= done_[it->second.stream];
  }
  void wait(EventId e) override {
    std::lock_guard lk(mu_);
    auto it = events_.find(e);
    if (it == events_.end()) throw std::logic_error("fake: wait on an unknown event");
    ++waits_;
    auto& d = done_[it->second.stream];
    d = std::max(d, it->second.ticket);
  }
  void destroy(EventId e) noexcept override {
    std::lock_guard lk(mu_);
    if (!events_.erase(e)) ++bad_destroys_;
  }
  bool capturing(StreamId s) override {
    std::lock_guard lk(mu_);
    return capturing_.count(s) > 0;
  }

  void complete(StreamId s) {
    std::lock_guard lk(mu_);
    done_[s] = recorded_[s];
  }
  void set_auto(bool on) {
    std::lock_guard lk(mu_);
    auto_ = on;
  }
  void set_capturing(StreamId s, bool on) {
    std::lock_guard lk(mu_);
    if (on) {
      capturing_.insert(s);
    } else {
      capturing_.erase(s);
    }
  }
  void set_fail_records(bool on) {
    std::lock_guard lk(mu_);
    fail_records_ = on;
  }
  int records() {
    std::lock_guard lk(mu_);
    return records_;
  }
  int waits() {
    std::lock_guard lk(mu_);
    return waits_;
  }
  size_t live_events() {
    std::lock_guard lk(mu_);
    return events_.size();
  }
  int bad_destroys() {
    std::lock_guard lk(mu_);
    return bad_destroys_;
  }

 private:
  struct Ev {
    StreamId stream;
    uint64_t ticket;
  };
  std::mutex mu_;
  std::map<EventId, Ev> events_;
  std::map<StreamId, uint64_t> recorded_, done_;
  std::set<StreamId> capturing_;
  EventId next_event_ = 1;
  bool auto_ = false, fail_records_ = false;
  int records_ = 0, queries_ = 0, waits_ = 0, bad_destroys_ = 0;
};

// Live ranges handed out: a block handed out twice, or overlapping another,
// fails the test.
class LiveRanges {
 public:
  void add(void* p, uint64_t size) {
    std::lock_guard lk(mu_);
    auto a = reinterpret_cast<uintptr_t>(p);
    auto next = ranges_.lower_bound(a);
    if (next != ranges_.end()) {
      ASSERT_GE(next->first, a + size) << "block at " << a << " overlaps one at " << next->first;
    }
    if (next != ranges_.begin()) {
      auto prev = std::prev(next);
      ASSERT_LE(prev->first + prev->second, a)
          << "block at " << a << " overlaps one at " << prev->first;
    }
    ranges_[a] = size;
  }
  void remove(void* p) {
    std::lock_guard lk(mu_);
    ASSERT_EQ(ranges_.erase(reinterpret_cast<uintptr_t>(p)), 1u);
  }

 private:
  std::mutex mu_;
  std::map<uintptr_t, uint64_t> ranges_;
};

BlockCacheOptions small_options(uint64_t budget = 0) {
  BlockCacheOptions o;
  o.budget_bytes = budget;
  o.lease_alignment = 2 * kMiB;
  return o;
}

TEST(BlockCache, ReusesOnTheSameStreamWithoutEvents) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  void* a = cache.allocate(4000, kS1);
  cache.free(a);
  void* b = cache.allocate(4000, kS1);
  EXPECT_EQ(a, b);
  EXPECT_EQ(streams.records(), 0);
  EXPECT_EQ(streams.waits(), 0);
  EXPECT_EQ(leases.acquires(), 1);
  cache.free(b);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, NoReuseOnAnotherStreamBeforeTheEventCompletes) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  void* a = cache.allocate(kMiB, kS1);  // a and x fill a 2 MiB small segment
  void* x = cache.allocate(kMiB, kS1);
  cache.free(a);
  // S1's work on `a` may still run: S2 gets other memory (a new lease), and
  // an event is recorded on S1 to learn when `a` is free for everyone.
  void* b = cache.allocate(kMiB, kS2);
  EXPECT_NE(a, b);
  EXPECT_EQ(streams.records(), 1);
  EXPECT_EQ(leases.acquires(), 2);
  void* c = cache.allocate(kMiB, kS2);
  EXPECT_NE(a, c);
  EXPECT_EQ(streams.records(), 1) << "one outstanding event per stream";
  streams.complete(kS1);
  void* d = cache.allocate(kMiB, kS2);
  EXPECT_EQ(a, d);
  EXPECT_EQ(streams.waits(), 0) << "reuse never waits when memory is plentiful";
  EXPECT_EQ(leases.acquires(), 2);
  for (void* p : {x, b, c, d}) cache.free(p);
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_EQ(streams.bad_destroys(), 0);
}

TEST(BlockCache, AnEventRecordedBeforeAFreeDoesNotCoverIt) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  // a, m, x, n fill a small segment; m and n stay live between them.
  void* a = cache.allocate(512 * kKiB, kS1);
  void* m = cache.allocate(512 * kKiB, kS1);
  void* x = cache.allocate(512 * kKiB, kS1);
  void* n = cache.allocate(512 * kKiB, kS1);
  cache.free(x);
  std::vector<void*> s2;
  s2.push_back(cache.allocate(512 * kKiB, kS2));  // records S1's event (it covers x, not a)
  for (int i = 0; i < 3; ++i) s2.push_back(cache.allocate(512 * kKiB, kS2));  // S2's segment
  cache.free(a);          // freed after that event
  streams.complete(kS1);  // the event completes
  void* z = cache.allocate(512 * kKiB, kS2);
  EXPECT_EQ(z, x);
  void* w = cache.allocate(512 * kKiB, kS2);
  EXPECT_NE(w, a) << "a was freed after the event that completed";
  EXPECT_EQ(streams.records(), 2) << "a second event on S1, for a";
  EXPECT_EQ(leases.acquires(), 3);
  for (void* p : {m, n, z, w}) cache.free(p);
  for (void* p : s2) cache.free(p);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, RecordStreamDelaysReuseUntilTheUsersFinish) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  void* a = cache.allocate(kMiB, kS1);
  cache.record_stream(a, kS2);
  cache.record_stream(a, kS2);  // once is enough
  cache.record_stream(a, kS1);  // its own stream: nothing to do
  cache.free(a);
  EXPECT_EQ(streams.records(), 1) << "an event on S2 at free time";
  void* b = cache.allocate(kMiB, kS1);  // the rest of the segment
  void* c = cache.allocate(kMiB, kS1);
  EXPECT_NE(a, c) << "S2 may still use it: even S1 must not reuse it";
  EXPECT_EQ(leases.acquires(), 2);
  streams.complete(kS2);
  void* d = cache.allocate(kMiB, kS1);
  EXPECT_EQ(a, d) << "S2 finished: S1 (its stream) reuses it at once";
  cache.free(d);
  // S3 still needs S1's own event.
  void* e = cache.allocate(kMiB, kS3);  // the rest of c's segment
  void* f = cache.allocate(kMiB, kS3);  // S1's event recorded, not complete: a new lease
  void* g = cache.allocate(kMiB, kS3);
  for (void* p : {e, f, g}) EXPECT_NE(a, p);
  streams.complete(kS1);
  void* h = cache.allocate(kMiB, kS3);
  EXPECT_EQ(a, h);
  for (void* p : {b, c, e, f, g, h}) cache.free(p);
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_THROW(cache.record_stream(a, kS2), std::invalid_argument);
}

TEST(BlockCache, BudgetFailureNamesRequestInUseCachedAndBudget) {
  FakeLeases leases(/*virtual_memory=*/true);
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options(6 * kGiB));
  void* big = cache.allocate(5 * kGiB, kS1);
  void* b = cache.allocate(768 * kMiB, kS1);
  cache.free(b);
  void* c = cache.allocate(512 * kMiB, kS1);  // splits the 768 MiB segment: 256 MiB cached
  EXPECT_EQ(c, b);
  try {
    cache.allocate(512 * kMiB, kS1);
    FAIL() << "allocated past the budget";
  } catch (const OutOfMemory& e) {
    EXPECT_STREQ(e.what(),
                 "leasehold: cannot allocate 512.00 MiB: 5.50 GiB in use, 256.00 MiB cached, "
                 "budget 6.00 GiB");
  }
  EXPECT_EQ(cache.stats().failed_allocations, 1u);
  EXPECT_LE(cache.stats().leased_bytes, 6 * kGiB);
  // Larger than the budget: refused at once, without waiting for anything.
  int waits = streams.waits();
  EXPECT_THROW(cache.allocate(7 * kGiB, kS1), OutOfMemory);
  EXPECT_EQ(streams.waits(), waits);
  cache.free(big);
  cache.free(c);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, OverBudgetReleasesCachedSegmentsAndLeasesAnew) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options(24 * kMiB));
  void* small = cache.allocate(100 * kKiB, kS1);  // a 2 MiB small segment
  cache.free(small);
  void* large = cache.allocate(22 * kMiB, kS1);  // 22 MiB + 2 MiB = the budget
  void* s2 = cache.allocate(100 * kKiB, kS1);    // reuses the small segment
  EXPECT_EQ(s2, small);
  cache.free(s2);
  cache.free(large);
  // 23 MiB: only after both cached segments went back (waiting for S1's
  // event on them, never for a whole device).
  void* huge = cache.allocate(23 * kMiB, kS1);
  EXPECT_NE(huge, nullptr);
  EXPECT_EQ(leases.releases(), 2);
  EXPECT_GE(streams.waits(), 1);
  EXPECT_EQ(cache.stats().leased_bytes, 24 * kMiB);
  cache.free(huge);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, WaitsForAnotherStreamsBlocksBeforeGivingUp) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options(20 * kMiB));
  void* a = cache.allocate(8 * kMiB, kS1);  // a 20 MiB segment: 8 live, 12 free
  cache.free(a);                            // S1's 8 MiB, the 12 MiB ready
  void* b = cache.allocate(16 * kMiB, kS2);
  // No room to lease: S2 waited for an event on S1, after which the 8 and
  // 12 MiB blocks merged.
  EXPECT_EQ(b, a);
  EXPECT_EQ(leases.acquires(), 1);
  EXPECT_EQ(streams.waits(), 1);
  cache.free(b);
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_EQ(streams.live_events(), 0u);
}

TEST(BlockCache, RefusedLeaseGivesBackTheCacheAndRetries) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  leases.set_capacity(24 * kMiB);
  void* a = cache.allocate(20 * kMiB, kS1);
  cache.free(a);
  streams.complete(kS1);
  void* b = cache.allocate(22 * kMiB, kS1);  // the pool refuses until the 20 MiB come back
  EXPECT_NE(b, nullptr);
  EXPECT_EQ(leases.releases(), 1);
  EXPECT_EQ(leases.last_resorts(), 1);
  try {
    cache.allocate(4 * kMiB, kS1);
    FAIL() << "the pool is full";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "budget none; a lease was refused: the pool is full"),
              std::string::npos)
        << e.what();
  }
  cache.free(b);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, LostSessionFailsTheAllocation) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  void* a = cache.allocate(kMiB, kS1);
  leases.set_lost();
  EXPECT_THROW(cache.allocate(30 * kMiB, kS1), LeaseFailure);
  cache.free(a);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, SplitsAndMergesFreeNeighbours) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  void* a = cache.allocate(256 * kKiB, kS1);
  void* b = cache.allocate(256 * kKiB, kS1);
  void* c = cache.allocate(256 * kKiB, kS1);
  auto base = reinterpret_cast<uintptr_t>(a);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b), base + 256 * kKiB);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(c), base + 512 * kKiB);
  cache.free(a);
  cache.free(c);
  auto segs = cache.segments();
  ASSERT_EQ(segs.size(), 1u);
  ASSERT_EQ(segs[0].blocks.size(), 4u);  // a, b, c, and the ready rest
  cache.free(b);                         // a+b+c merge; the rest is ready: kept apart
  segs = cache.segments();
  ASSERT_EQ(segs[0].blocks.size(), 2u);
  EXPECT_EQ(segs[0].blocks[0].size, 768 * kKiB);
  EXPECT_EQ(segs[0].blocks[0].state, BlockInfo::State::kFree);
  void* d = cache.allocate(768 * kKiB, kS1);  // the merged block, whole
  EXPECT_EQ(d, a);
  void* e = cache.allocate(kMiB, kS1);  // from the rest
  EXPECT_EQ(reinterpret_cast<uintptr_t>(e), base + 768 * kKiB);
  EXPECT_EQ(leases.acquires(), 1);
  cache.free(d);
  cache.free(e);  // d and e merge (S1's); the 256 KiB rest is ready
  // S3 cannot use S1's blocks before S1's event: a new lease.
  void* f = cache.allocate(512 * kKiB, kS3);
  EXPECT_EQ(leases.acquires(), 2);
  streams.complete(kS1);
  // The event completed: S1's block is ready and merges with the rest, the
  // whole segment one free block again.
  void* g = cache.allocate(64 * kKiB, kS3);
  bool whole = false;
  for (const auto& seg : cache.segments()) {
    if (seg.base == base) {
      whole = seg.blocks.size() == 1 && seg.blocks[0].ready && seg.blocks[0].size == 2 * kMiB;
    }
  }
  EXPECT_TRUE(whole);
  cache.free(f);
  cache.free(g);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, LargeBlocksAreNotCutIntoCrumbs) {
  FakeLeases leases(true);
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  void* a = cache.allocate(19 * kMiB + 512 * kKiB, kS1);  // 20 MiB segment: 512 KiB left
  EXPECT_EQ(cache.block_size(a), 20 * kMiB) << "a remainder under 1 MiB is not split off";
  void* b = cache.allocate(5 * kMiB, kS1);  // another 20 MiB segment: 15 MiB split off
  EXPECT_EQ(cache.block_size(b), 5 * kMiB);
  void* c = cache.allocate(kMiB + 512, kS1);  // small limit is 1 MiB: the large pool
  EXPECT_EQ(cache.block_size(c), kMiB + 512);
  EXPECT_EQ(leases.acquires(), 2);
  void* d = cache.allocate(512, kS1);  // small pool: its own 2 MiB segment
  EXPECT_EQ(leases.acquires(), 3);
  EXPECT_EQ(cache.block_size(d), 512u);
  for (void* p : {a, b, c, d}) cache.free(p);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, CountsLeasesUseAndHits) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options(64 * kMiB));
  void* a = cache.allocate(1000, kS1);  // 1024 B in use, one 2 MiB lease
  void* b = cache.allocate(30 * kMiB, kS1);
  auto st = cache.stats();
  EXPECT_EQ(st.allocations, 2u);
  EXPECT_EQ(st.cache_hits, 0u);
  EXPECT_EQ(st.lease_requests, 2u);
  EXPECT_EQ(st.segments, 2u);
  EXPECT_EQ(st.leased_bytes, 32 * kMiB);
  EXPECT_EQ(st.in_use_bytes, 30 * kMiB + 1024);
  EXPECT_EQ(st.budget_bytes, 64 * kMiB);
  cache.free(b);
  void* c = cache.allocate(10 * kMiB, kS1);
  st = cache.stats();
  EXPECT_EQ(st.allocations, 3u);
  EXPECT_EQ(st.cache_hits, 1u);
  EXPECT_EQ(st.in_use_bytes, 10 * kMiB + 1024);
  EXPECT_EQ(st.peak_in_use_bytes, 30 * kMiB + 1024);
  EXPECT_EQ(st.peak_leased_bytes, 32 * kMiB);
  cache.free(a);
  cache.free(c);
  EXPECT_EQ(cache.trim(UINT64_MAX), 32 * kMiB);
  st = cache.stats();
  EXPECT_EQ(st.leased_bytes, 0u);
  EXPECT_EQ(st.peak_leased_bytes, 32 * kMiB);
  EXPECT_EQ(st.in_use_bytes, 0u);
  EXPECT_EQ(leases.leased(), 0u);
}

TEST(BlockCache, TrimReleasesOnlyFullyFreeSegmentsAndWaitsForTheirEvents) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  void* keep = cache.allocate(kMiB, kS1);  // small segment 1 stays busy
  void* gone = cache.allocate(30 * kMiB, kS2);
  cache.free(gone);
  EXPECT_EQ(cache.trim(1), 30 * kMiB);
  EXPECT_EQ(streams.waits(), 1) << "one event on S2, waited for";
  EXPECT_EQ(streams.live_events(), 0u);
  EXPECT_EQ(cache.trim(UINT64_MAX), 0u) << "a segment with a live block stays";
  cache.free(keep);
  EXPECT_EQ(cache.empty_cache(), 2 * kMiB);
  EXPECT_EQ(cache.stats().segments, 0u);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, BlocksOfACaptureAreKeptAsideUntilEmptyCacheAfterIt) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  void* before = cache.allocate(64 * kKiB, kS1);
  cache.free(before);  // S1's, not known to be finished
  streams.set_capturing(kS1, true);
  void* a = cache.allocate(64 * kKiB, kS1);
  EXPECT_NE(a, before) << "a capture only takes ready blocks";
  int records = streams.records();
  cache.free(a);
  EXPECT_EQ(streams.records(), records) << "no event on a capturing stream";
  void* b = cache.allocate(64 * kKiB, kS1);
  EXPECT_NE(b, a);
  EXPECT_EQ(cache.stats().held_bytes, 64 * kKiB);
  cache.empty_cache();  // the capture is still under way: nothing returns
  EXPECT_EQ(cache.stats().held_bytes, 64 * kKiB);
  streams.set_capturing(kS1, false);
  cache.free(b);  // allocated during the capture: kept aside too
  EXPECT_EQ(cache.stats().held_bytes, 128 * kKiB);
  void* c = cache.allocate(64 * kKiB, kS1);
  EXPECT_NE(c, a);
  EXPECT_NE(c, b);
  cache.free(c);
  EXPECT_EQ(cache.check_invariants(), "");
  cache.empty_cache();
  EXPECT_EQ(cache.stats().held_bytes, 0u);
  EXPECT_EQ(cache.stats().segments, 0u);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, ExhaustedDuringCaptureFailsWithoutWaiting) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options(20 * kMiB));
  void* a = cache.allocate(20 * kMiB, kS1);
  cache.free(a);
  streams.set_capturing(kS1, true);
  try {
    cache.allocate(20 * kMiB, kS1);
    FAIL();
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("during CUDA graph capture"), std::string::npos);
  }
  EXPECT_EQ(streams.waits(), 0);
  streams.set_capturing(kS1, false);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, BadPointersAndFailedEventsLeaveItConsistent) {
  FakeLeases leases;
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options());
  int x;
  EXPECT_THROW(cache.free(&x), std::invalid_argument);
  EXPECT_THROW(cache.allocate(0, kS1), std::invalid_argument);
  void* a = cache.allocate(4096, kS1);
  cache.record_stream(a, kS2);
  streams.set_fail_records(true);
  EXPECT_THROW(cache.free(a), std::runtime_error);
  streams.set_fail_records(false);
  EXPECT_EQ(cache.stats().held_bytes, 4096u) << "its users unknown: kept aside";
  EXPECT_THROW(cache.free(a), std::invalid_argument) << "freed once";
  EXPECT_EQ(cache.check_invariants(), "");
  cache.empty_cache();
  EXPECT_EQ(cache.stats().held_bytes, 0u);
  EXPECT_EQ(cache.check_invariants(), "");
}

TEST(BlockCache, DestructionReleasesEveryLease) {
  FakeLeases leases;
  FakeStreams streams;
  {
    BlockCache cache(leases, streams, small_options());
    cache.allocate(kMiB, kS1);
    void* b = cache.allocate(40 * kMiB, kS2);
    cache.record_stream(b, kS3);
    cache.free(b);
  }
  EXPECT_EQ(leases.leased(), 0u);
  EXPECT_EQ(leases.bad_releases(), 0);
  EXPECT_EQ(streams.live_events(), 0u);
}

// Trim and empty_cache from one thread while another allocates and frees on
// two streams: no block handed out twice, nothing overlapping, every
// allocation's bytes intact until its free.
// Fills [p, p + size) with bytes derived from `seed`; holds() checks them.
void paint(void* p, uint64_t size, uint8_t seed) {
  auto* b = static_cast<uint8_t*>(p);
  for (uint64_t i = 0; i < size; i += 4096) b[i] = static_cast<uint8_t>(seed + i / 4096);
  b[size - 1] = seed;
}
bool painted(const void* p, uint64_t size, uint8_t seed) {
  auto* b = static_cast<const uint8_t*>(p);
  for (uint64_t i = 0; i < size; i += 4096) {
    if (b[i] != static_cast<uint8_t>(seed + i / 4096)) return false;
  }
  return b[size - 1] == seed;
}

// The defect expandable segments fix: half of a 64 MiB budget is free, in
// 4 MiB holes between live blocks, and a 24 MiB request fails although it
// fits beside the live bytes. A paging source serves it from the holes'
// pages, and the live blocks keep their bytes.
TEST(BlockCachePaging, FreePagesBetweenLiveBlocksBackANewSegment) {
  constexpr uint64_t kPage = 64 * kKiB, kBudget = 64 * kMiB;
  BlockCacheOptions o = small_options(kBudget);
  o.lease_alignment = kPage;
  FakeStreams streams;
  std::vector<void*> blocks;
  {
    // Without paging: the request fails, naming the cached fragments.
    FakeLeases plain;
    BlockCache cache(plain, streams, o);
    for (int i = 0; i < 16; ++i) blocks.push_back(cache.allocate(4 * kMiB, kS1));
    for (int i = 0; i < 16; i += 2) cache.free(blocks[i]);
    EXPECT_THROW(cache.allocate(24 * kMiB, kS1), OutOfMemory);
    for (int i = 1; i < 16; i += 2) cache.free(blocks[i]);
  }
  blocks.clear();
  PagedLeases paged(kPage, kBudget / kPage);
  {
    BlockCache cache(paged, streams, o);
    for (int i = 0; i < 16; ++i) {
      blocks.push_back(cache.allocate(4 * kMiB, kS1));
      paint(blocks.back(), 4 * kMiB, static_cast<uint8_t>(i));
    }
    for (int i = 0; i < 16; i += 2) cache.free(blocks[i]);
    void* big = cache.allocate(24 * kMiB, kS1);
    paint(big, 24 * kMiB, 99);
    for (int i = 1; i < 16; i += 2) {
      EXPECT_TRUE(painted(blocks[i], 4 * kMiB, static_cast<uint8_t>(i))) << "block " << i;
    }
    EXPECT_TRUE(painted(big, 24 * kMiB, 99));
    BlockCacheStats st = cache.stats();
    EXPECT_GE(st.unbacked_bytes, 24 * kMiB - (kBudget - 64 * kMiB));
    EXPECT_GE(st.unbacks, 1u);
    EXPECT_LE(st.leased_bytes, kBudget);
    EXPECT_EQ(st.leased_bytes, paged.shown_bytes());
    EXPECT_EQ(cache.check_invariants(), "");
    // Unbacked ranges are never handed out; their segments go back whole
    // once free.
    for (int i = 1; i < 16; i += 2) cache.free(blocks[i]);
    cache.free(big);
    EXPECT_EQ(cache.check_invariants(), "");
    cache.empty_cache();
    EXPECT_EQ(cache.stats().leased_bytes, 0u);
    EXPECT_EQ(cache.stats().unbacked_bytes, 0u);
    EXPECT_EQ(paged.shown_bytes(), 0u);
  }
  EXPECT_EQ(paged.bad_calls(), 0);
}

// Trim (a Shrink) unbacks free pages of partly used segments when fully
// free segments are not enough.
TEST(BlockCachePaging, TrimUnbacksFreePagesOfPartlyUsedSegments) {
  constexpr uint64_t kPage = 64 * kKiB;
  BlockCacheOptions o = small_options(0);
  o.lease_alignment = kPage;
  FakeStreams streams;
  PagedLeases paged(kPage, 1024);
  BlockCache cache(paged, streams, o);
  void* a = cache.allocate(8 * kMiB, kS1);  // one 20 MiB segment: a, b, rest
  void* b = cache.allocate(8 * kMiB, kS1);
  paint(b, 8 * kMiB, 7);
  cache.free(a);
  void* c = cache.allocate(kKiB, kS2);  // a small segment
  // a's pages may still be in use by S1's queued work: trim waits for an
  // event on S1 before it unbacks them (and never for a whole device).
  const int waits = streams.waits();
  const uint64_t got = cache.trim(12 * kMiB);
  EXPECT_GT(streams.waits(), waits);
  EXPECT_GE(got, 12 * kMiB);
  EXPECT_TRUE(painted(b, 8 * kMiB, 7));
  EXPECT_EQ(cache.stats().leased_bytes, paged.shown_bytes());
  EXPECT_EQ(cache.check_invariants(), "");
  cache.free(b);
  cache.free(c);
  EXPECT_EQ(cache.check_invariants(), "");
}

// Random allocations and frees on a budget with a paging source: an
// allocation fails only when the live blocks, the pages at their edges and
// the request exceed the budget, never because of cached fragments; no two
// live blocks share memory (each keeps its bytes); the source never holds
// more than the budget.
TEST(BlockCachePaging, RandomTensorsFailOnlyWhenLiveBytesAndRequestExceedTheBudget) {
  constexpr uint64_t kPage = 64 * kKiB, kBudget = 96 * kMiB;
  BlockCacheOptions o = small_options(kBudget);
  o.lease_alignment = kPage;
  o.small_segment = 2 * kMiB;
  FakeStreams streams;
  streams.set_auto(true);
  PagedLeases paged(kPage, kBudget / kPage);
  BlockCache cache(paged, streams, o);
  std::mt19937 gen(2028);
  struct Held {
    void* p;
    uint64_t size;
    uint8_t seed;
  };
  std::vector<Held> held;
  int failures = 0, served = 0;
  for (int i = 0; i < 4000; ++i) {
    if (gen() % 100 < 55) {
      const uint64_t size =
          gen() % 4 == 0 ? gen() % (24 * kMiB) + 1 : gen() % (768 * kKiB) + 1;
      const BlockCacheStats before = cache.stats();
      try {
        void* p = cache.allocate(size, kS1);
        const auto seed = static_cast<uint8_t>(gen());
        paint(p, size, seed);
        held.push_back({p, size, seed});
        ++served;
      } catch (const OutOfMemory& e) {
        ++failures;
        // What live blocks may pin besides their bytes: the pages at both
        // edges, a large block's unsplit rest (up to small_limit), and the
        // small pool's 2 MiB segments.
        const uint64_t slack = held.size() * (2 * kPage + o.small_limit) + 2 * kMiB;
        ASSERT_GT(before.in_use_bytes + size + slack, kBudget)
            << "failed with " << before.in_use_bytes << " in use for " << size << ": "
            << e.what();
      }
    } else if (!held.empty()) {
      const size_t k = gen() % held.size();
      ASSERT_TRUE(painted(held[k].p, held[k].size, held[k].seed)) << "operation " << i;
      cache.free(held[k].p);
      held[k] = held.back();
      held.pop_back();
    }
    if (i % 500 == 0) {
      ASSERT_EQ(cache.check_invariants(), "") << "after operation " << i;
      ASSERT_LE(paged.shown_bytes(), kBudget);
    }
  }
  for (const Held& h : held) {
    ASSERT_TRUE(painted(h.p, h.size, h.seed));
    cache.free(h.p);
  }
  EXPECT_GT(served, 1000);
  EXPECT_GT(cache.stats().unbacks, 0u);
  EXPECT_EQ(cache.check_invariants(), "");
  cache.empty_cache();
  EXPECT_EQ(paged.shown_bytes(), 0u);
  EXPECT_EQ(paged.bad_calls(), 0);
}

TEST(BlockCacheThreads, TrimWhileAnotherThreadAllocates) {
  FakeLeases leases;
  FakeStreams streams;
  streams.set_auto(true);  // events complete when queried
  BlockCache cache(leases, streams, small_options(96 * kMiB));
  LiveRanges ranges;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> trimmed{0};
  std::thread trimmer([&] {
    std::mt19937 gen(7);
    while (!stop) {
      trimmed += gen() % 4 == 0 ? cache.empty_cache() : cache.trim(gen() % (32 * kMiB));
      std::this_thread::yield();
    }
  });
  auto worker = [&](uint32_t seed, int rounds) {
    std::mt19937 gen(seed);
    struct Held {
      void* p;
      uint64_t size;
      unsigned char tag;
    };
    std::vector<Held> held;
    auto release = [&](const Held& h) {
      auto* bytes = static_cast<unsigned char*>(h.p);
      for (uint64_t j = 0; j < std::min<uint64_t>(h.size, 64); ++j) ASSERT_EQ(bytes[j], h.tag);
      ASSERT_EQ(bytes[h.size - 1], h.tag);
      ranges.remove(h.p);
      cache.free(h.p);
    };
    // The rounds, and more while the trimmer (a thread a busy machine may
    // not have run yet) has trimmed nothing: the test is of trims that
    // overlap allocation.
    for (int i = 0; i < rounds || (trimmed.load() == 0 && i < 50 * rounds); ++i) {
      if (i % 1000 == 999) {  // now and then everything goes: whole segments fall free
        for (auto& h : held) release(h);
        held.clear();
      } else if (held.size() < 40 && gen() % 3 != 0) {
        uint64_t size = gen() % 4 == 0 ? (gen() % (12 * kMiB)) + 1 : (gen() % (512 * kKiB)) + 1;
        StreamId s = gen() % 2 ? kS1 : kS2;
        void* p;
        try {
          p = cache.allocate(size, s);
        } catch (const OutOfMemory&) {
          continue;
        }
        ranges.add(p, size);
        auto tag = static_cast<unsigned char>(gen());
        std::memset(p, tag, std::min<uint64_t>(size, 64));
        static_cast<unsigned char*>(p)[size - 1] = tag;
        held.push_back({p, size, tag});
      } else if (!held.empty()) {
        size_t k = gen() % held.size();
        Held h = held[k];
        held[k] = held.back();
        held.pop_back();
        release(h);
      }
    }
    for (auto& h : held) release(h);
  };
  std::thread w1(worker, 1, 20000);
  std::thread w2(worker, 2, 20000);
  w1.join();
  w2.join();
  stop = true;
  trimmer.join();
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_GT(trimmed.load(), 0u);
  auto st = cache.stats();
  EXPECT_EQ(st.in_use_bytes, 0u);
  EXPECT_LE(st.peak_leased_bytes, 96 * kMiB);
  cache.empty_cache();
  EXPECT_EQ(cache.stats().leased_bytes, 0u);
  EXPECT_EQ(leases.leased(), 0u);
}

// Random operations on three streams, with events completing at random and
// captures now and then; the invariants are checked along the way and
// nothing handed out ever overlaps.
TEST(BlockCacheStress, RandomOperationsKeepTheInvariants) {
  FakeLeases leases(true);
  FakeStreams streams;
  BlockCache cache(leases, streams, small_options(256 * kMiB));
  LiveRanges ranges;
  std::mt19937 gen(12345);
  const StreamId kStreams[] = {kS1, kS2, kS3};
  std::vector<std::pair<void*, uint64_t>> held;
  bool capturing = false;
  for (int i = 0; i < 30000; ++i) {
    unsigned op = gen() % 100;
    StreamId s = kStreams[gen() % 3];
    if (op < 45) {
      uint64_t size = gen() % 8 == 0 ? gen() % (40 * kMiB) + 1 : gen() % (2 * kMiB) + 1;
      try {
        void* p = cache.allocate(size, s);
        ranges.add(p, size);
        EXPECT_GE(cache.block_size(p), size);
        held.emplace_back(p, size);
      } catch (const OutOfMemory&) {
      }
    } else if (op < 85 && !held.empty()) {
      size_t k = gen() % held.size();
      ranges.remove(held[k].first);
      cache.free(held[k].first);
      held[k] = held.back();
      held.pop_back();
    } else if (op < 90 && !held.empty()) {
      cache.record_stream(held[gen() % held.size()].first, s);
    } else if (op < 96) {
      streams.complete(s);
    } else if (op < 98) {
      cache.trim(gen() % (64 * kMiB));
    } else if (op < 99) {
      cache.empty_cache();
    } else {
      capturing = !capturing;
      streams.set_capturing(kS3, capturing);
    }
    if (i % 1000 == 0) {
      ASSERT_EQ(cache.check_invariants(), "") << "after operation " << i;
    }
  }
  streams.set_capturing(kS3, false);
  for (auto& [p, size] : held) {
    ranges.remove(p);
    cache.free(p);
  }
  ASSERT_EQ(cache.check_invariants(), "");
  for (StreamId s : kStreams) streams.complete(s);
  EXPECT_EQ(cache.stats().in_use_bytes, 0u);
  EXPECT_LE(cache.stats().peak_leased_bytes, 256 * kMiB);
  cache.empty_cache();
  EXPECT_EQ(cache.stats().leased_bytes, 0u);
  EXPECT_EQ(cache.stats().held_bytes, 0u);
  EXPECT_EQ(cache.check_invariants(), "");
  EXPECT_EQ(streams.bad_destroys(), 0);
}

}  // namespace
}  // namespace leasehold::torch_plugin
