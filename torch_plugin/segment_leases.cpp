#include "torch_plugin/segment_leases.h"

#include <algorithm>
#include <exception>
#include <set>
#include <vector>

#include "torch_plugin/rounding.h"
#include "torch_plugin/stream_order.h"

namespace leasehold::torch_plugin::detail {

uint64_t SegmentLeases::room() const {
  uint64_t used = leased_bytes_ + reserved_;
  return opt_.budget_bytes > used ? opt_.budget_bytes - used : 0;
}

uint64_t SegmentLeases::segment_bytes(uint64_t size, bool small) const {
  const uint64_t a = opt_.lease_alignment;
  uint64_t need = round_up(size, a);
  if (need == 0) return 0;
  uint64_t preferred =
      std::max(need, round_up(small ? opt_.small_segment : opt_.min_large_segment, a));
  if (opt_.budget_bytes == 0) return preferred;
  uint64_t r = room();
  if (need > r) return 0;
  return preferred <= r ? preferred : std::max(need, round_down(r, a));
}

Block* SegmentLeases::lease_segment(std::unique_lock<std::mutex>& lk, uint64_t size, bool small,
                                    bool last_resort, bool minimal, std::string* refusal) {
  uint64_t want = segment_bytes(size, small);
  if (want == 0) return nullptr;
  if (minimal) want = round_up(size, opt_.lease_alignment);
  reserved_ += want;
  ++lease_requests_;
  Lease lease;
  std::string why;
  LeaseSource::Result r = LeaseSource::Result::kFailed;
  lk.unlock();
  try {
    r = source_.acquire(want, last_resort, &lease, &why);
  } catch (const std::exception& e) {
    why = e.what();
  } catch (...) {
    why = "unknown exception from the lease source";
  }
  lk.lock();
  reserved_ -= want;
  if (r == LeaseSource::Result::kRefused) {
    *refusal = why.empty() ? "refused" : why;
    return nullptr;
  }
  const uint64_t page = source_.page_size();
  if (r == LeaseSource::Result::kGranted &&
      (lease.base == nullptr || lease.size < size ||
       reinterpret_cast<uintptr_t>(lease.base) % opt_.granularity != 0 ||
       (page && lease.size % page != 0))) {
    source_.release(lease.id);
    why = "the lease source granted " + format_bytes(lease.size) + " at " +
          std::to_string(reinterpret_cast<uintptr_t>(lease.base)) + " for " + format_bytes(want) +
          " (unusable)";
    r = LeaseSource::Result::kFailed;
  }
  if (r != LeaseSource::Result::kGranted) {
    throw LeaseFailure("leasehold: cannot lease memory: " + why);
  }
  Block* b = pool_.add_segment(lease, small);
  leased_bytes_ += lease.size;
  peak_leased_bytes_ = std::max(peak_leased_bytes_, leased_bytes_);
  return b;
}

uint64_t SegmentLeases::release_segments(std::unique_lock<std::mutex>& lk, uint64_t bytes) {
  if (bytes == 0 || pool_.free_segments().empty()) return 0;
  struct Candidate {
    Segment* seg;
    std::vector<StreamId> owners;  // streams whose work on it may be queued still
  };
  std::vector<Candidate> cands;
  for (Segment* seg : pool_.free_segments()) {
    Candidate c{seg, {}};
    bool skip = false;
    for (Block* b = seg->first; b; b = b->next) {
      if (b->ready || b->state == BState::kUnbacked) continue;
      if (std::find(c.owners.begin(), c.owners.end(), b->stream) == c.owners.end()) {
        c.owners.push_back(b->stream);
      }
    }
    for (StreamId s : c.owners) skip = skip || streams_.capturing(s);
    if (!skip) cands.push_back(std::move(c));
  }
  std::sort(cands.begin(), cands.end(), [](const Candidate& x, const Candidate& y) {
    if (x.owners.empty() != y.owners.empty()) return x.owners.empty();
    return x.seg->lease.size - x.seg->unbacked > y.seg->lease.size - y.seg->unbacked;
  });
  std::vector<Segment*> chosen;
  std::set<StreamId> owners;
  uint64_t total = 0;
  for (const auto& c : cands) {
    if (total >= bytes) break;
    chosen.push_back(c.seg);
    owners.insert(c.owners.begin(), c.owners.end());
    total += c.seg->lease.size - c.seg->unbacked;
  }
  if (chosen.empty()) return 0;
  for (Segment* seg : chosen) pool_.begin_release(seg);
  auto undo = [&] {
    for (Segment* seg : chosen) pool_.cancel_release(seg);
  };
  std::vector<Recorded> evs;
  try {
    evs = record_each(streams_, {owners.begin(), owners.end()});
  } catch (...) {
    undo();
    throw;
  }
  lk.unlock();
  try {
    for (const auto& r : evs) streams_.wait(r.event);
  } catch (...) {
    lk.lock();
    destroy_all(streams_, evs);
    undo();
    throw;
  }
  for (Segment* seg : chosen) source_.release(seg->lease.id);
  lk.lock();
  destroy_all(streams_, evs);
  uint64_t released = 0;
  for (Segment* seg : chosen) {
    const uint64_t backed = seg->lease.size - seg->unbacked;
    leased_bytes_ -= backed;
    unbacked_bytes_ -= seg->unbacked;
    released += backed;
    pool_.remove_segment(seg);
  }
  return released;
}

uint64_t SegmentLeases::unback_free(uint64_t bytes) {
  const uint64_t page = source_.page_size();
  if (page == 0 || bytes == 0) return 0;
  struct Candidate {
    Block* block;
    uint64_t offset, size;  // the whole pages inside it, relative to it
  };
  std::vector<Candidate> cands;
  for (Segment* seg : pool_.segments()) {
    if (seg->releasing) continue;
    const uintptr_t base = reinterpret_cast<uintptr_t>(seg->lease.base);
    for (Block* b = seg->first; b; b = b->next) {
      if (b->state != BState::kFree || !b->ready) continue;
      const uint64_t first = round_up(b->addr - base, page);
      const uint64_t end = round_down(b->addr - base + b->size, page);
      if (end > first) cands.push_back({b, base + first - b->addr, end - first});
    }
  }
  std::sort(cands.begin(), cands.end(),
            [](const Candidate& x, const Candidate& y) { return x.size > y.size; });
  uint64_t done = 0;
  for (const Candidate& c : cands) {
    if (done >= bytes) break;
    Segment* seg = c.block->seg;
    const uint64_t at = c.block->addr + c.offset - reinterpret_cast<uintptr_t>(seg->lease.base);
    source_.unback(seg->lease.id, at, c.size);
    pool_.unback(c.block, c.offset, c.size);
    leased_bytes_ -= c.size;
    unbacked_bytes_ += c.size;
    done += c.size;
  }
  if (done) ++unbacks_;
  return done;
}

void SegmentLeases::release_all() noexcept {
  for (Segment* seg : pool_.segments()) source_.release(seg->lease.id);
}

}  // namespace leasehold::torch_plugin::detail
