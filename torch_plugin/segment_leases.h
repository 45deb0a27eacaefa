// Segments in and out of the lease source, within the budget (internal to
// the block cache: block_cache.h states the rules). A new segment is one
// lease: the request rounded to the lease alignment, grown to the preferred
// segment size where the budget leaves room (fewer leases for a run of
// requests, at the cost of holding some memory more). Giving back picks
// fully free segments, first those no stream's work may still touch, then
// the largest, and waits only for the events their blocks need. Where the
// source pages its leases, the whole pages inside free blocks of partly
// used segments can be given back too (unback_free); the budget counts
// what the segments still show.
//
// The lease source is never called with the cache's lock held: asking the
// coordinator for memory can take long (a queue), and frees and trims of
// other threads go on meanwhile. Bytes being leased count against the
// budget as if granted, so concurrent allocations cannot overshoot it.
//
// Thread safety: none; the cache's mutex guards it. Functions taking the
// cache's lock release it while they call the lease source or wait, and
// hold it again on return and on a throw.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include "torch_plugin/block_cache.h"
#include "torch_plugin/block_pool.h"

namespace leasehold::torch_plugin::detail {

class SegmentLeases {
 public:
  // All four must outlive it; segments leased go into `pool`.
  SegmentLeases(LeaseSource& source, StreamOps& streams, BlockPool& pool,
                const BlockCacheOptions& opt)
      : source_(source), streams_(streams), pool_(pool), opt_(opt) {}
  SegmentLeases(const SegmentLeases&) = delete;
  SegmentLeases& operator=(const SegmentLeases&) = delete;

  // The bytes the budget leaves for new leases (0 when it has no room).
  uint64_t room() const;
  // Leases a segment for `size` bytes (`lk` released meanwhile) and
  // returns its one free block; nullptr when the budget has no room or the
  // source refused (its reason in `refusal`). `minimal`: no larger than
  // `size` needs (the preferred segment size was refused already).
  // `last_resort` is passed on to the source. Throws LeaseFailure when the
  // source failed or granted unusable memory (which it gets back).
  Block* lease_segment(std::unique_lock<std::mutex>& lk, uint64_t size, bool small,
                       bool last_resort, bool minimal, std::string* refusal);
  // Releases fully free segments until `bytes` were released or none is
  // left: ones whose blocks all are ready first, then the largest. Waits
  // (`lk` released) for the events their blocks need first; segments of a
  // stream being captured stay. Returns the bytes released. Throws what
  // StreamOps throws, every segment kept.
  uint64_t release_segments(std::unique_lock<std::mutex>& lk, uint64_t bytes);
  // Where the source pages its leases: unbacks the whole pages of ready
  // free blocks (largest first) until `bytes` were unbacked or none is
  // left. The source's work is quick and the lock stays held. Returns the
  // bytes unbacked.
  uint64_t unback_free(uint64_t bytes);
  // Gives every segment's lease back, blocks in use included: the cache
  // goes away. Never throws.
  void release_all() noexcept;

  // Leased now, less unbacked pages: what counts against the budget.
  uint64_t leased_bytes() const { return leased_bytes_; }
  uint64_t unbacked_bytes() const { return unbacked_bytes_; }
  uint64_t page_size() const { return source_.page_size(); }
  uint64_t unbacks() const { return unbacks_; }
  uint64_t peak_leased_bytes() const { return peak_leased_bytes_; }
  uint64_t lease_requests() const { return lease_requests_; }

 private:
  // The lease size for a new segment holding `size` bytes; 0 when the
  // budget has no room for it.
  uint64_t segment_bytes(uint64_t size, bool small) const;

  LeaseSource& source_;
  StreamOps& streams_;
  BlockPool& pool_;
  const BlockCacheOptions& opt_;
  uint64_t reserved_ = 0;      // bytes being leased (counted against the budget)
  uint64_t leased_bytes_ = 0;  // leased now (including segments being released), less unbacked
  uint64_t unbacked_bytes_ = 0;
  uint64_t unbacks_ = 0;
  uint64_t peak_leased_bytes_ = 0;
  uint64_t lease_requests_ = 0;  // acquire() calls, granted or not
};

}  // namespace leasehold::torch_plugin::detail
