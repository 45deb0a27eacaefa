#include "agent/spill/tiered_store.h"

#include "agent/spill/spill_file.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

#include "agent/spill/host_tier.h"
#include "shared/pool_allocator.h"
#include "shared/units.h"

// Header-only use of xxHash: no runtime library to ship or find.
#define XXH_INLINE_ALL
#include <xxhash.h>

namespace leasehold::spill {
namespace {

constexpr uint64_t kPage = SpillFile::kPage;

using Clock = std::chrono::steady_clock;

std::string bytes_text(uint64_t n) { return std::to_string(n) + " bytes"; }

Status from_exception(const std::string& context, const std::exception& e) {
  // A device fault (CudaError) or an allocation failure: no errno of its own.
  return Status::io_error(context + ": " + e.what(), EIO);
}

}  // namespace

class TieredSpillStore::Impl {
 public:
  Impl(Transfer& transfer, TieredStoreOptions options);
  ~Impl();

  Status put(SpillId id, const void* src, size_t bytes, const std::string& name);
  bool copied(SpillId id);
  Status wait_copied(SpillId id);
  void prefetch(SpillId id);
  Status get(SpillId id, void* dst, std::shared_ptr<Fence>* done);
  void erase(SpillId id);
  SpillStats stats() const;
  std::shared_ptr<engine::Allocator> host_allocator() const { return host_allocator_; }
  Status flush();
  std::string file_path() const;

 private:
  enum class Tier : uint8_t { None, Host, File };
  // A staging slot: Free (reusable once `h2d` is done), Writing (holds a
  // chunk copied off the device until the I/O thread has written it),
  // Reading (an I/O thread is reading a chunk into it) or Loaded (holds a
  // chunk read back, or the error of that read, until a get uses it).
  enum class SlotState : uint8_t { Free, Writing, Reading, Loaded };

  struct Chunk {
    uint64_t offset = 0;  // in the file
    size_t len = 0;       // tensor bytes; the file holds it padded to kPage
    uint64_t hash = 0;    // XXH3 of the padded bytes, valid when written
    bool written = false;
    int slot = -1;               // the staging slot holding its bytes, if any
    std::shared_ptr<Fence> d2h;  // the copy into its slot; null once seen done
  };

  struct Entry {
    std::string name;
    size_t bytes = 0;
    Tier tier = Tier::None;
    uint64_t offset = 0;           // host-tier region or file extent
    std::shared_ptr<Fence> fence;  // host tier: the copy into the region
    std::vector<Chunk> chunks;     // file tier
    int io_pending = 0;            // I/O tasks queued or running for it
    Status error;                  // a failed copy or write: its bytes are lost
  };

  struct Slot {
    SlotState state = SlotState::Free;
    SpillId owner = 0;
    size_t chunk = 0;
    bool prefetched = false;     // counted in prefetch_slots_
    Status read_status;          // Loaded: the outcome of the read
    std::shared_ptr<Fence> h2d;  // the last copy out of it to the device
    uint64_t last_use = 0;
  };

  struct Task {
    bool write = true;
    SpillId id = 0;
    size_t chunk = 0;
    int slot = -1;
    uint64_t offset = 0;
    size_t len = 0;
    uint64_t hash = 0;             // read: the expected checksum
    std::shared_ptr<Fence> fence;  // write: the copy into the slot
    std::string name;
  };

  // A task for chunk `k` of `e` in slot `s`; the caller adds what differs.
  static Task task_for(bool write, SpillId id, const Entry& e, size_t k, int s);
  void enqueue_locked(Entry& e, Task t);  // REQUIRES: mu_ held
  char* slot_data(int s) const { return opt_.staging->data() + static_cast<size_t>(s) * chunk_; }
  std::string chunk_where(const Task& t) const {
    return "chunk " + std::to_string(t.chunk) + " of tensor " + t.name + " (offset " +
           std::to_string(t.offset) + ")";
  }

  Status put_host(std::unique_lock<std::mutex>& lock, SpillId id, const char* src, size_t bytes,
                  const std::string& name, uint64_t offset);
  Status put_file(std::unique_lock<std::mutex>& lock, SpillId id, const char* src, size_t bytes,
                  const std::string& name);
  Status get_file(std::unique_lock<std::mutex>& lock, SpillId id, Entry& e, char* dst,
                  std::shared_ptr<Fence>* done);
  Status no_room(const std::string& name, size_t bytes, const std::string& why) const;
  Status open_file_locked();

  // A slot that is free now, or -1. REQUIRES: mu_ held.
  int take_free_slot_locked();
  // Waits until a slot is free. Loaded slots are taken back from their
  // chunks when nothing else can free one (prefetched data of other
  // entries first, then `keep`'s chunks after `keep_chunk`, farthest first).
  // Returns -1 only when no slot can ever be had. May release the lock.
  int acquire_slot(std::unique_lock<std::mutex>& lock, std::optional<SpillId> keep,
                   size_t keep_chunk);
  void release_slot_locked(int s);
  void issue_read_locked(SpillId id, Entry& e, size_t k, int s, bool prefetched);
  // Waits for the entry's I/O, then frees everything it holds and forgets it.
  void drop_locked(std::unique_lock<std::mutex>& lock, SpillId id);

  void start_threads_locked();
  void worker();
  void run_write(Task& t);
  void run_read(Task& t);
  void io_begin();
  void io_end();

  Transfer& transfer_;
  TieredStoreOptions opt_;
  size_t chunk_ = 0;
  int nslots_ = 0;
  int max_prefetch_slots_ = 0;
  Status file_tier_problem_;  // why the options allow no file tier (empty: allowed)

  mutable std::mutex mu_;
  std::condition_variable io_done_;     // an I/O task finished
  std::condition_variable work_ready_;  // a task was queued, or stop_
  std::deque<Task> tasks_;
  std::vector<std::thread> threads_;
  bool stop_ = false;

  std::unordered_map<SpillId, Entry> entries_;
  std::shared_ptr<HostTier> host_;  // null: no host tier
  std::shared_ptr<engine::Allocator> host_allocator_;  // host_'s planned tensors (null: none)
  std::vector<Slot> slots_;
  int prefetch_slots_ = 0;
  uint64_t use_clock_ = 0;
  int io_pending_ = 0;
  Status sticky_;  // the first failed write: later puts fail with it

  std::unique_ptr<SpillFile> file_;  // created at the first file-tier put
  std::string path_;                 // file_'s, for messages

  SpillStats stats_;  // all but the busy times

  // Wall time with at least one read or write in flight (own lock: taken
  // around every syscall, never while waiting for mu_).
  mutable std::mutex busy_mu_;
  int io_active_ = 0;
  Clock::time_point io_since_;
  Clock::duration io_busy_{};
};

TieredSpillStore::Impl::Impl(Transfer& transfer, TieredStoreOptions options)
    : transfer_(transfer), opt_(std::move(options)), chunk_(opt_.chunk_bytes) {
  if (opt_.host_tier && opt_.host_tier->size() >= kPage) {
    host_ = std::make_shared<HostTier>(opt_.host_tier->data(), opt_.host_tier->size(),
                                       opt_.host_limit, kPage);
    // (A tier under one page holds no planned tensor: none are planned.)
    if (host_->limit() >= kPage) {
      host_allocator_ = std::make_shared<HostTierAllocator>(host_, transfer_.device());
    }
  }
  // Bad options disable the file tier with a reason that put() reports, so
  // that construction never fails (see the header).
  if (!opt_.staging || opt_.directory.empty()) {
    file_tier_problem_ = Status::invalid_argument("no spill file configured");
  } else if (chunk_ == 0 || chunk_ % kPage != 0) {
    file_tier_problem_ = Status::invalid_argument("spill chunk size " + bytes_text(chunk_) +
                                                  " is not a positive multiple of 4 KiB");
  } else if (opt_.staging->size() / chunk_ < 2) {
    file_tier_problem_ =
        Status::invalid_argument("spill staging buffer of " + bytes_text(opt_.staging->size()) +
                                 " holds fewer than 2 chunks of " + bytes_text(chunk_));
  } else if (opt_.io_threads < 1) {
    file_tier_problem_ = Status::invalid_argument("spill store needs at least one I/O thread");
  } else {
    nslots_ = static_cast<int>(opt_.staging->size() / chunk_);
    max_prefetch_slots_ = std::max(1, nslots_ / 2);
    slots_.resize(static_cast<size_t>(nslots_));
  }
}

TieredSpillStore::Impl::~Impl() {
  std::unique_lock lock(mu_);
  // The tasks read and write the caller's staging buffer and this object.
  io_done_.wait(lock, [&] { return io_pending_ == 0; });
  stop_ = true;
  lock.unlock();
  work_ready_.notify_all();
  for (auto& t : threads_) t.join();
  // Copies out of the host tier and the staging buffer may still be queued
  // on the copy stream; the caller frees those buffers after the store.
  if (stats_.bytes_out > 0) {
    try {
      transfer_.mark()->wait();
    } catch (const std::exception& ex) {
      spdlog::error("spill store: waiting for copies in flight: {}", ex.what());
    }
  }
  file_.reset();  // closes and removes the file
  // (The job's tensors go before its spill manager: a range still held
  // would be handed out again by the next job's store over the same tier.)
  if (host_allocator_ && host_allocator_->stats().in_use_bytes > 0) {
    spdlog::critical("spill store: {} of the job's page-locked tensors outlive its host tier",
                     format_bytes(host_allocator_->stats().in_use_bytes));
  }
}

Status TieredSpillStore::Impl::no_room(const std::string& name, size_t bytes,
                                       const std::string& why) const {
  std::string host = host_ ? format_bytes(host_->used_bytes()) + " of " +
                                  format_bytes(host_->limit()) + " used"
                            : std::string("none");
  if (host_allocator_ && host_allocator_->stats().in_use_bytes > 0) {
    host += " (" + format_bytes(host_allocator_->stats().in_use_bytes) +
            " of it the job's page-locked tensors)";
  }
  return Status::io_error("no room to spill tensor " + name + " (" + bytes_text(bytes) +
                              "): host tier " + host + ", " + why,
                          ENOSPC);
}

Status TieredSpillStore::Impl::put(SpillId id, const void* src, size_t bytes,
                                   const std::string& name) {
  std::unique_lock lock(mu_);
  if (!sticky_.ok()) return sticky_;
  if (entries_.count(id)) {
    return Status::invalid_argument("spill id " + std::to_string(id) + " (tensor " + name +
                                    ") is already stored");
  }
  const char* p = static_cast<const char*>(src);
  if (bytes == 0) {
    Entry& e = entries_[id];
    e.name = name;
    return Status::OK();
  }
  if (host_) {
    if (const auto offset = host_->allocate(bytes, PoolAllocator::End::Low)) {
      return put_host(lock, id, p, bytes, name, *offset);
    }
  }
  if (!file_tier_problem_.ok()) {
    if (file_tier_problem_.is_io_error()) return file_tier_problem_;
    return no_room(name, bytes, file_tier_problem_.message());
  }
  return put_file(lock, id, p, bytes, name);
}

Status TieredSpillStore::Impl::put_host(std::unique_lock<std::mutex>& lock, SpillId id,
                                        const char* src, size_t bytes, const std::string& name,
                                        uint64_t offset) {
  Entry& e = entries_[id];
  e.name = name;
  e.bytes = bytes;
  e.tier = Tier::Host;
  e.offset = offset;
  // Copies run without the lock: only this thread touches the region.
  lock.unlock();
  std::shared_ptr<Fence> fence;
  Status st;
  try {
    transfer_.to_host(host_->data(offset), src, bytes);
    fence = transfer_.mark();
  } catch (const std::exception& ex) {
    st = from_exception("cannot copy tensor " + name + " off the device", ex);
  }
  lock.lock();
  if (!st.ok()) {
    host_->free(offset);
    entries_.erase(id);
    return st;
  }
  e.fence = std::move(fence);
  stats_.host_bytes += bytes;
  stats_.peak_host_bytes = std::max(stats_.peak_host_bytes, stats_.host_bytes);
  stats_.bytes_out += bytes;
  return Status::OK();
}

Status TieredSpillStore::Impl::open_file_locked() {
  if (file_) return Status::OK();
  std::unique_ptr<SpillFile> file;
  Status st = SpillFile::create(opt_.directory, opt_.tag, opt_.direct_io, opt_.file_limit, &file);
  if (!st.ok()) return st;
  try {
    start_threads_locked();
  } catch (const std::exception& ex) {
    // The threads that did start are stopping: no file tier from now on
    // (`file` is removed on return).
    file_tier_problem_ = from_exception("cannot start the spill store's I/O threads", ex);
    return file_tier_problem_;
  }
  path_ = file->path();
  file_ = std::move(file);
  return Status::OK();
}

Status TieredSpillStore::Impl::put_file(std::unique_lock<std::mutex>& lock, SpillId id,
                                        const char* src, size_t bytes, const std::string& name) {
  Status st = open_file_locked();
  if (!st.ok()) return st;
  std::optional<uint64_t> placed = file_->place(bytes);
  if (!placed) return no_room(name, bytes, file_->fullness());
  const uint64_t offset = *placed;
  st = file_->grow_to(offset + align_up(bytes, kPage));
  if (!st.ok()) {
    file_->free(offset);
    return st;
  }

  Entry& e = entries_[id];
  e.name = name;
  e.bytes = bytes;
  e.tier = Tier::File;
  e.offset = offset;
  size_t n = (bytes + chunk_ - 1) / chunk_;
  e.chunks.resize(n);
  for (size_t k = 0; k < n; ++k) {
    e.chunks[k].offset = offset + k * chunk_;
    e.chunks[k].len = std::min(chunk_, bytes - k * chunk_);
  }
  stats_.file_bytes += bytes;
  stats_.peak_file_bytes = std::max(stats_.peak_file_bytes, stats_.file_bytes);

  for (size_t k = 0; k < n; ++k) {
    int s = -1;
    try {
      s = acquire_slot(lock, std::nullopt, 0);
    } catch (const std::exception& ex) {
      st = from_exception("cannot spill tensor " + name + ": waiting for a staging buffer", ex);
    }
    if (st.ok() && s < 0) {
      st =
          Status::io_error("cannot spill tensor " + name + ": no staging buffer can be had", EBUSY);
    }
    if (!st.ok()) break;
    Slot& slot = slots_[static_cast<size_t>(s)];
    slot.state = SlotState::Writing;  // reserved: no other thread takes a Writing slot
    slot.owner = id;
    slot.chunk = k;
    slot.prefetched = false;
    slot.last_use = ++use_clock_;
    Chunk& c = e.chunks[k];
    c.slot = s;
    size_t len = c.len;
    char* dst = slot_data(s);
    // The copy runs without the lock, so finished writes can free slots.
    lock.unlock();
    std::shared_ptr<Fence> fence;
    try {
      transfer_.to_host(dst, src + k * chunk_, len);
      fence = transfer_.mark();
    } catch (const std::exception& ex) {
      st = from_exception("cannot copy tensor " + name + " off the device", ex);
    }
    lock.lock();
    if (!st.ok()) {
      release_slot_locked(s);
      c.slot = -1;
      break;
    }
    c.d2h = fence;
    Task t = task_for(/*write=*/true, id, e, k, s);
    t.len = len;
    t.fence = std::move(fence);
    enqueue_locked(e, std::move(t));
  }
  if (!st.ok()) {
    drop_locked(lock, id);
    return st;
  }
  stats_.bytes_out += bytes;
  return Status::OK();
}

int TieredSpillStore::Impl::take_free_slot_locked() {
  for (int i = 0; i < nslots_; ++i) {
    Slot& s = slots_[static_cast<size_t>(i)];
    if (s.state != SlotState::Free) continue;
    if (s.h2d) {
      if (!s.h2d->done()) continue;
      s.h2d.reset();
    }
    return i;
  }
  return -1;
}

int TieredSpillStore::Impl::acquire_slot(std::unique_lock<std::mutex>& lock,
                                         std::optional<SpillId> keep, size_t keep_chunk) {
  for (;;) {
    int s = take_free_slot_locked();
    if (s >= 0) return s;
    // The oldest copy out of a free slot: wait for it on the host.
    int oldest = -1;
    bool io_busy = false;
    for (int i = 0; i < nslots_; ++i) {
      const Slot& slot = slots_[static_cast<size_t>(i)];
      if (slot.state == SlotState::Free &&
          (oldest < 0 || slot.last_use < slots_[static_cast<size_t>(oldest)].last_use)) {
        oldest = i;
      }
      io_busy |= slot.state == SlotState::Writing || slot.state == SlotState::Reading;
    }
    if (oldest >= 0) {
      std::shared_ptr<Fence> f = slots_[static_cast<size_t>(oldest)].h2d;
      lock.unlock();
      try {
        f->wait();
      } catch (...) {
        lock.lock();
        throw;
      }
      lock.lock();
      continue;
    }
    if (io_busy) {
      io_done_.wait(lock);
      continue;
    }
    // Every slot holds a chunk read back for a later get: take one back,
    // the one needed last. Its chunk is simply read again when needed.
    // Other entries' chunks (prefetched for later gets) go first, oldest
    // first; then the chunks of `keep` farthest after `keep_chunk`.
    auto rank = [&](const Slot& slot) {
      bool mine = keep && slot.owner == *keep;
      return std::pair<int, uint64_t>(mine ? 1 : 0, mine ? UINT64_MAX - slot.chunk : slot.last_use);
    };
    int victim = -1;
    for (int i = 0; i < nslots_; ++i) {
      const Slot& slot = slots_[static_cast<size_t>(i)];
      if (slot.state != SlotState::Loaded) continue;
      if (keep && slot.owner == *keep && slot.chunk <= keep_chunk) continue;
      if (victim < 0 || rank(slot) < rank(slots_[static_cast<size_t>(victim)])) victim = i;
    }
    if (victim < 0) return -1;
    Slot& v = slots_[static_cast<size_t>(victim)];
    entries_.at(v.owner).chunks[v.chunk].slot = -1;
    release_slot_locked(victim);
  }
}

void TieredSpillStore::Impl::release_slot_locked(int s) {
  Slot& slot = slots_[static_cast<size_t>(s)];
  if (slot.prefetched) --prefetch_slots_;
  slot.state = SlotState::Free;
  slot.owner = 0;
  slot.chunk = 0;
  slot.prefetched = false;
  slot.read_status = Status::OK();
}

void TieredSpillStore::Impl::issue_read_locked(SpillId id, Entry& e, size_t k, int s,
                                               bool prefetched) {
  Chunk& c = e.chunks[k];
  Slot& slot = slots_[static_cast<size_t>(s)];
  slot.state = SlotState::Reading;
  slot.owner = id;
  slot.chunk = k;
  slot.prefetched = prefetched;
  slot.read_status = Status::OK();
  slot.last_use = ++use_clock_;
  if (prefetched) ++prefetch_slots_;
  c.slot = s;
  Task t = task_for(/*write=*/false, id, e, k, s);
  t.hash = c.hash;
  enqueue_locked(e, std::move(t));
}

TieredSpillStore::Impl::Task TieredSpillStore::Impl::task_for(bool write, SpillId id,
                                                              const Entry& e, size_t k, int s) {
  Task t;
  t.write = write;
  t.id = id;
  t.chunk = k;
  t.slot = s;
  t.offset = e.chunks[k].offset;
  t.len = e.chunks[k].len;
  t.name = e.name;
  return t;
}

void TieredSpillStore::Impl::enqueue_locked(Entry& e, Task t) {
  tasks_.push_back(std::move(t));
  ++e.io_pending;
  ++io_pending_;
  work_ready_.notify_one();
}

void TieredSpillStore::Impl::drop_locked(std::unique_lock<std::mutex>& lock, SpillId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  io_done_.wait(lock, [&] { return e.io_pending == 0; });
  if (e.tier == Tier::Host) {
    // A copy into the region may still run: the next put's copy into it is
    // queued behind it on the same copy stream, and a planned tensor waits
    // for it (host_tier.h).
    host_->free_after(e.offset, e.fence);
    stats_.host_bytes -= e.bytes;
  } else if (e.tier == Tier::File) {
    for (Chunk& c : e.chunks) {
      if (c.slot >= 0) release_slot_locked(c.slot);
    }
    file_->free(e.offset);
    stats_.file_bytes -= e.bytes;
  }
  entries_.erase(it);
}

bool TieredSpillStore::Impl::copied(SpillId id) {
  std::lock_guard lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return true;
  Entry& e = it->second;
  try {
    if (e.fence) {
      if (!e.fence->done()) return false;
      e.fence.reset();
    }
    for (Chunk& c : e.chunks) {
      if (!c.d2h) continue;
      if (!c.d2h->done()) return false;
      c.d2h.reset();
    }
  } catch (const std::exception& ex) {
    // The copy will never finish: report done so the caller moves on to
    // wait_copied() or get(), which report the fault.
    if (e.error.ok())
      e.error = from_exception("cannot copy tensor " + e.name + " off the device", ex);
  }
  return true;
}

Status TieredSpillStore::Impl::wait_copied(SpillId id) {
  std::unique_lock lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return Status::not_found("spill id " + std::to_string(id) + " is not stored");
  }
  Entry& e = it->second;
  std::vector<std::shared_ptr<Fence>> fences;
  if (e.fence) fences.push_back(e.fence);
  for (const Chunk& c : e.chunks) {
    if (c.d2h) fences.push_back(c.d2h);
  }
  lock.unlock();
  Status st;
  try {
    for (auto& f : fences) f->wait();
  } catch (const std::exception& ex) {
    st = from_exception("cannot copy tensor " + e.name + " off the device", ex);
  }
  lock.lock();
  // The entry is still there: only this thread erases.
  if (!st.ok() && e.error.ok()) e.error = st;
  if (st.ok()) {
    e.fence.reset();
    for (Chunk& c : e.chunks) c.d2h.reset();
  }
  return e.error;
}

void TieredSpillStore::Impl::prefetch(SpillId id) {
  std::lock_guard lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.tier != Tier::File || !it->second.error.ok()) return;
  Entry& e = it->second;
  try {
    for (size_t k = 0; k < e.chunks.size() && prefetch_slots_ < max_prefetch_slots_; ++k) {
      const Chunk& c = e.chunks[k];
      if (c.slot >= 0 || !c.written) continue;
      int s = take_free_slot_locked();
      if (s < 0) break;
      issue_read_locked(id, e, k, s, /*prefetched=*/true);
    }
  } catch (const std::exception& ex) {
    // A hint only; a device fault seen here surfaces again at the next get.
    spdlog::debug("spill prefetch of tensor {}: {}", e.name, ex.what());
  }
}

// `done` null: the compute stream waits for the copies; else *done is
// their fence and the caller orders the compute stream (get_async).
Status TieredSpillStore::Impl::get(SpillId id, void* dst, std::shared_ptr<Fence>* done) {
  std::unique_lock lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return Status::not_found("spill id " + std::to_string(id) + " is not stored");
  }
  Entry& e = it->second;
  if (!e.error.ok()) return e.error;
  if (e.tier == Tier::None) return Status::OK();
  Status st;
  if (e.tier == Tier::Host) {
    lock.unlock();
    try {
      transfer_.to_device(dst, host_->data(e.offset), e.bytes);
      std::shared_ptr<Fence> f = transfer_.mark();
      if (done) {
        *done = std::move(f);
      } else {
        transfer_.compute_waits(f);
      }
    } catch (const std::exception& ex) {
      st = from_exception("cannot copy tensor " + e.name + " to the device", ex);
    }
    lock.lock();
  } else {
    try {
      st = get_file(lock, id, e, static_cast<char*>(dst), done);
    } catch (const std::exception& ex) {
      if (!lock.owns_lock()) lock.lock();
      st = from_exception("cannot bring tensor " + e.name + " back from spill file " + path_, ex);
    }
  }
  if (st.ok()) stats_.bytes_in += e.bytes;
  return st;
}

Status TieredSpillStore::Impl::get_file(std::unique_lock<std::mutex>& lock, SpillId id, Entry& e,
                                        char* dst, std::shared_ptr<Fence>* done) {
  const size_t n = e.chunks.size();
  std::shared_ptr<Fence> last;
  for (size_t k = 0; k < n;) {
    if (!e.error.ok()) return e.error;
    // Keep reads in flight ahead of the chunk being delivered, in chunk
    // order, as far as free slots allow.
    for (size_t j = k; j < n; ++j) {
      const Chunk& c = e.chunks[j];
      if (c.slot >= 0 || !c.written) continue;
      int s = take_free_slot_locked();
      if (s < 0) break;
      issue_read_locked(id, e, j, s, /*prefetched=*/false);
    }
    Chunk& c = e.chunks[k];
    if (c.slot < 0) {
      // Neither in staging nor on its way: its write finished after the
      // loop above looked, or no slot was free.
      int s = acquire_slot(lock, id, k);
      if (!e.error.ok()) return e.error;
      if (s < 0) {
        return Status::io_error("cannot read tensor " + e.name + " back from spill file " + path_ +
                                    ": no staging buffer can be had",
                                EBUSY);
      }
      if (c.slot >= 0) {
        // Cannot happen (only this thread gives chunks a slot), but taking a
        // second slot for the chunk would leak one.
        release_slot_locked(s);
      } else {
        issue_read_locked(id, e, k, s, /*prefetched=*/false);
      }
    }
    io_done_.wait(lock, [&] {
      return c.slot < 0 || slots_[static_cast<size_t>(c.slot)].state != SlotState::Reading;
    });
    if (c.slot < 0) continue;  // its write finished and freed the slot: read it back
    const int s = c.slot;
    Slot& slot = slots_[static_cast<size_t>(s)];
    const bool staged = slot.state == SlotState::Writing;
    if (!staged && !slot.read_status.ok()) {
      Status st = slot.read_status;
      c.slot = -1;
      release_slot_locked(s);
      return st;
    }
    if (staged) ++stats_.staging_hits;
    // The copy runs without the lock. A Writing slot may be freed by its
    // I/O thread meanwhile, but only this thread hands slots out again, and
    // it gives the slot its fence below first.
    const char* src = slot_data(s);
    const size_t len = c.len;
    lock.unlock();
    std::shared_ptr<Fence> f;
    try {
      transfer_.to_device(dst + k * chunk_, src, len);
      f = transfer_.mark();
    } catch (...) {
      lock.lock();
      if (!staged) {
        c.slot = -1;
        release_slot_locked(s);
      }
      throw;
    }
    lock.lock();
    slot.h2d = f;
    if (!staged) {
      c.slot = -1;
      release_slot_locked(s);
    }
    last = std::move(f);
    ++k;
  }
  if (done) {
    *done = std::move(last);
    return Status::OK();
  }
  lock.unlock();
  try {
    transfer_.compute_waits(last);
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  return Status::OK();
}

void TieredSpillStore::Impl::erase(SpillId id) {
  std::unique_lock lock(mu_);
  drop_locked(lock, id);
}

Status TieredSpillStore::Impl::flush() {
  std::unique_lock lock(mu_);
  io_done_.wait(lock, [&] { return io_pending_ == 0; });
  return sticky_;
}

SpillStats TieredSpillStore::Impl::stats() const {
  SpillStats s;
  {
    std::lock_guard lock(mu_);
    s = stats_;
  }
  {
    std::lock_guard lock(busy_mu_);
    Clock::duration busy = io_busy_;
    if (io_active_ > 0) busy += Clock::now() - io_since_;
    s.file_busy_seconds = std::chrono::duration<double>(busy).count();
  }
  try {
    s.copy_busy_seconds = transfer_.busy_seconds();
  } catch (const std::exception& ex) {
    spdlog::debug("spill store statistics: {}", ex.what());
  }
  return s;
}

std::string TieredSpillStore::Impl::file_path() const {
  std::lock_guard lock(mu_);
  return path_;
}

void TieredSpillStore::Impl::start_threads_locked() {
  if (!threads_.empty()) return;
  threads_.reserve(static_cast<size_t>(opt_.io_threads));
  try {
    for (int i = 0; i < opt_.io_threads; ++i) threads_.emplace_back([this] { worker(); });
  } catch (...) {
    // Called with mu_ held: the threads started so far are waiting for it
    // (or for work) and see stop_ once it is released.
    stop_ = true;
    work_ready_.notify_all();
    throw;
  }
}

void TieredSpillStore::Impl::worker() {
  for (;;) {
    Task t;
    {
      std::unique_lock lock(mu_);
      work_ready_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      t = std::move(tasks_.front());
      tasks_.pop_front();
    }
    if (t.write) {
      run_write(t);
    } else {
      run_read(t);
    }
  }
}

void TieredSpillStore::Impl::io_begin() {
  std::lock_guard lock(busy_mu_);
  if (io_active_++ == 0) io_since_ = Clock::now();
}

void TieredSpillStore::Impl::io_end() {
  std::lock_guard lock(busy_mu_);
  if (--io_active_ == 0) io_busy_ += Clock::now() - io_since_;
}

void TieredSpillStore::Impl::run_write(Task& t) {
  char* p = slot_data(t.slot);
  const size_t padded = align_up(t.len, kPage);
  uint64_t hash = 0;
  Status st;
  try {
    t.fence->wait();
  } catch (const std::exception& ex) {
    st = from_exception("cannot copy " + chunk_where(t) + " off the device", ex);
  }
  if (st.ok()) {
    // Padding to whole pages for O_DIRECT; the checksum covers it too, so
    // a read is checked exactly as it was written.
    std::memset(p + t.len, 0, padded - t.len);
    hash = XXH3_64bits(p, padded);
    io_begin();
    int err = file_->write(p, padded, t.offset);
    io_end();
    if (err != 0) {
      st = Status::io_error("cannot write " + chunk_where(t) + " to spill file " + path_, err);
    }
  }
  {
    std::lock_guard lock(mu_);
    Entry& e = entries_.at(t.id);
    Chunk& c = e.chunks[t.chunk];
    if (st.ok()) {
      c.d2h.reset();  // waited for above
      c.hash = hash;
      c.written = true;
      stats_.file_bytes_written += padded;
    } else {
      spdlog::error("spill store: {}", st.message());
      if (e.error.ok()) e.error = st;
      if (sticky_.ok()) sticky_ = st;
    }
    c.slot = -1;
    release_slot_locked(t.slot);
    --e.io_pending;
    --io_pending_;
  }
  io_done_.notify_all();
}

void TieredSpillStore::Impl::run_read(Task& t) {
  char* p = slot_data(t.slot);
  const size_t padded = align_up(t.len, kPage);
  io_begin();
  int err = file_->read(p, padded, t.offset);
  io_end();
  Status st;
  if (err > 0) {
    st = Status::io_error("cannot read " + chunk_where(t) + " from spill file " + path_, err);
  } else if (err < 0) {
    st = Status::corruption("spill file " + path_ + ": truncated in " + chunk_where(t));
  } else if (XXH3_64bits(p, padded) != t.hash) {
    st = Status::corruption("spill file " + path_ + ": checksum mismatch in " + chunk_where(t));
  }
  {
    std::lock_guard lock(mu_);
    Entry& e = entries_.at(t.id);
    Slot& slot = slots_[static_cast<size_t>(t.slot)];
    slot.state = SlotState::Loaded;
    slot.read_status = st;
    if (err == 0) stats_.file_bytes_read += padded;
    --e.io_pending;
    --io_pending_;
  }
  io_done_.notify_all();
}

TieredSpillStore::TieredSpillStore(Transfer& transfer, TieredStoreOptions options)
    : impl_(std::make_unique<Impl>(transfer, std::move(options))) {}

TieredSpillStore::~TieredSpillStore() = default;

Status TieredSpillStore::put(SpillId id, const void* src, size_t bytes, const std::string& name) {
  try {
    return impl_->put(id, src, bytes, name);
  } catch (const std::exception& ex) {
    return from_exception("cannot spill tensor " + name, ex);
  }
}

bool TieredSpillStore::copied(SpillId id) { return impl_->copied(id); }

Status TieredSpillStore::wait_copied(SpillId id) {
  try {
    return impl_->wait_copied(id);
  } catch (const std::exception& ex) {
    return from_exception("cannot wait for spilled tensor " + std::to_string(id), ex);
  }
}

void TieredSpillStore::prefetch(SpillId id) {
  try {
    impl_->prefetch(id);
  } catch (const std::exception& ex) {
    spdlog::debug("spill prefetch of id {}: {}", id, ex.what());
  }
}

Status TieredSpillStore::get(SpillId id, void* dst) {
  try {
    return impl_->get(id, dst, nullptr);
  } catch (const std::exception& ex) {
    return from_exception("cannot bring spilled tensor " + std::to_string(id) + " back", ex);
  }
}

Status TieredSpillStore::get_async(SpillId id, void* dst, std::shared_ptr<Fence>* done) {
  try {
    *done = nullptr;
    return impl_->get(id, dst, done);
  } catch (const std::exception& ex) {
    return from_exception("cannot bring spilled tensor " + std::to_string(id) + " back", ex);
  }
}

void TieredSpillStore::erase(SpillId id) {
  try {
    impl_->erase(id);
  } catch (const std::exception& ex) {
    spdlog::error("spill store: erasing id {}: {}", id, ex.what());
  }
}

SpillStats TieredSpillStore::stats() const { return impl_->stats(); }

std::shared_ptr<engine::Allocator> TieredSpillStore::host_allocator() {
  return impl_->host_allocator();
}

Status TieredSpillStore::flush() {
  try {
    return impl_->flush();
  } catch (const std::exception& ex) {
    return from_exception("cannot flush the spill store", ex);
  }
}

std::string TieredSpillStore::file_path() const { return impl_->file_path(); }

}  // namespace leasehold::spill
