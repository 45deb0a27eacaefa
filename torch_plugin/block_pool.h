// The block cache's map of its memory (internal to the cache: block_cache.h
// is the interface and states the rules). Segments are leases cut into
// blocks in address order; the free blocks of each pool (small, large) sit
// in sets ordered by size, so that best fit is one lower_bound. Handing a
// block out splits the rest off; freeing merges it with free neighbours.
//
// The pool decides where a request goes, never when memory may be reused:
// each free block carries the stream that freed it and whether every
// stream's work on it completed ("ready"). StreamOrder (stream_order.h)
// decides when a block becomes ready; the pool keeps ready blocks and each
// stream's own free blocks in separate sets, so that best_fit never offers
// a stream another stream's unready block, and merges only blocks that are
// reusable by the same streams.
//
// Thread safety: none; the cache's mutex guards it. Ownership: the pool owns
// its Segment and Block objects (deleted with it); the leases behind the
// segments are SegmentLeases' (segment_leases.h) to give back.
#pragma once

#include <cstdint>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "torch_plugin/block_cache.h"

namespace leasehold::torch_plugin::detail {

using BState = BlockInfo::State;

struct Segment;

// One block of a segment: live (handed out), free (in a free set), waiting
// (freed, events of record_stream users outstanding), held (kept aside for
// CUDA graphs), releasing (its segment goes back) or unbacked (whole pages
// whose memory the lease source took back: addresses only, never handed
// out, never merged).
struct Block {
  uintptr_t addr = 0;
  uint64_t size = 0;
  Segment* seg = nullptr;
  Block* prev = nullptr;  // neighbours in address order within the segment
  Block* next = nullptr;
  BState state = BState::kFree;
  // kFree: reusable by any stream (every stream's work on it completed);
  // otherwise reusable at once only by `stream`.
  bool ready = false;
  // Allocated while `stream` was being captured into a graph.
  bool captured = false;
  // kLive: the allocation's stream; otherwise the stream that freed it.
  StreamId stream = 0;
  // When it was freed (the cache's free counter): an event recorded on
  // `stream` once the counter is at least this covers it.
  uint64_t free_seq = 0;
  int pending = 0;             // kWaiting: events still outstanding
  std::vector<StreamId> uses;  // kLive: record_stream's other streams
};

// One lease, cut into blocks.
struct Segment {
  Lease lease;
  bool small = false;
  uint64_t busy = 0;       // blocks neither kFree nor kUnbacked
  uint64_t unbacked = 0;   // bytes in kUnbacked blocks
  bool releasing = false;  // going back to the lease source
  Block* first = nullptr;
};

class BlockPool {
 public:
  // `opt` must outlive the pool.
  explicit BlockPool(const BlockCacheOptions& opt) : opt_(opt) {}
  // Deletes every segment and block; their leases must have gone back.
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // ---- segments -------------------------------------------------------------

  // Adds a segment over `lease` (of the small pool when `small`) and
  // returns its one block: free and ready, since nothing ever ran on it.
  Block* add_segment(const Lease& lease, bool small);
  // Takes idle segment `seg` (one of free_segments()) out of use while its
  // lease goes back: its blocks leave the free sets and become kReleasing.
  void begin_release(Segment* seg);
  // Undoes begin_release: the lease could not go back after all.
  void cancel_release(Segment* seg);
  // Forgets a segment whose lease went back: deletes it and its blocks.
  void remove_segment(Segment* seg);
  // Every segment held now.
  const std::unordered_set<Segment*>& segments() const { return segments_; }
  // The segments whose every block is free and that are not being
  // released: the ones trim may give back.
  const std::unordered_set<Segment*>& free_segments() const { return free_segments_; }

  // ---- placement --------------------------------------------------------------

  // The smallest free block of the pool holding `size` bytes that `stream`
  // may use now: a ready block, or one `stream` freed itself (ties go to
  // the latter); during a capture (`capturing`) a ready block only. nullptr
  // when there is none.
  Block* best_fit(bool small, uint64_t size, StreamId stream, bool capturing);
  // Hands free block `b` (best_fit's) out as a live block of `size` bytes
  // on `stream`. The rest is split off as a free block where it is worth
  // it: any rest in the small pool; in the large pool only more than
  // `small_limit`, so that large segments are not cut into crumbs.
  void take(Block* b, uint64_t size, StreamId stream, bool capturing);
  // A live, waiting or held block becomes free: reusable at once by its
  // stream, or by any stream when `ready`. It merges with free neighbours.
  void make_free(Block* b, bool ready);
  // Free block `b`, ready, gives up [offset, offset + bytes) of its range
  // (the lease source unbacked those pages): that part becomes a kUnbacked
  // block, the rest before and after stays free.
  void unback(Block* b, uint64_t offset, uint64_t bytes);
  // Every block `s` freed up to `watermark` (the cache's free counter, once
  // all the stream's work up to then is known complete) becomes ready.
  void promote(StreamId s, uint64_t watermark);

  // ---- what stream order asks ---------------------------------------------------

  // The streams owning free blocks of the pool that are not ready yet, in
  // the order of the pool's index.
  std::vector<StreamId> owners(bool small) const;
  // ... of them, those owning such a block of at least `size` bytes.
  std::vector<StreamId> owners_of(bool small, uint64_t size) const;

  // ---- invariant checks (block_cache_check.cpp) ---------------------------------

  // Whether neighbours `a` and `b` ought to be one block: both free and
  // reusable by the same streams.
  static bool mergeable(const Block* a, const Block* b);
  // Whether free block `b` is in the free set its readiness and stream say.
  bool in_free_set(const Block* b) const;
  struct FreeSetCount {
    uint64_t blocks = 0;      // blocks in all free sets
    uint64_t empty_sets = 0;  // per-stream sets kept although empty (a bug)
  };
  FreeSetCount count_free_sets() const;

 private:
  // Free sets order blocks by size, then address: best fit is a lower_bound.
  struct BySize {
    bool operator()(const Block* a, const Block* b) const {
      return a->size != b->size ? a->size < b->size : a->addr < b->addr;
    }
  };
  using FreeSet = std::set<Block*, BySize>;
  struct Pool {
    std::unordered_map<StreamId, FreeSet> owned;  // free blocks by the stream that freed them
    FreeSet ready;                                // free blocks any stream may use
  };

  Pool& pool(bool small) { return pools_[small ? 1 : 0]; }
  const Pool& pool(bool small) const { return pools_[small ? 1 : 0]; }
  void insert_free(Block* b);
  void erase_free(Block* b);
  // `b` is kFree and in no set: merges it with compatible free neighbours
  // and inserts the result.
  Block* merge_and_insert(Block* b);
  void became_busy(Segment* s);
  void became_idle(Segment* s);

  const BlockCacheOptions& opt_;
  Pool pools_[2];  // [0]: large, [1]: small
  std::unordered_set<Segment*> segments_;
  std::unordered_set<Segment*> free_segments_;  // busy == 0 and not releasing
};

}  // namespace leasehold::torch_plugin::detail
