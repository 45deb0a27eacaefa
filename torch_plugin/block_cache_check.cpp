// BlockCache::check_invariants (tests): walks every segment's block list and
// compares what it finds with the indexes and counters the parts keep, so a
// test sees a broken link, a block in the wrong set, a missed merge or a
// counter that drifted right after the operation that caused it.
#include <sstream>

#include "torch_plugin/block_cache_state.h"

namespace leasehold::torch_plugin {

using detail::Block;
using detail::BlockPool;
using detail::BState;
using detail::Segment;

std::string BlockCache::State::check() const {
  std::ostringstream err;
  uint64_t leased = 0, in_use = 0, held_bytes = 0, free_blocks = 0, live_blocks = 0;
  uint64_t unbacked_total = 0;
  const uint64_t page = leases.page_size();
  for (Segment* seg : pool.segments()) {
    leased += seg->lease.size - seg->unbacked;
    unbacked_total += seg->unbacked;
    const uintptr_t base = reinterpret_cast<uintptr_t>(seg->lease.base);
    uintptr_t at = base;
    uint64_t busy = 0, unbacked = 0;
    const Block* prev = nullptr;
    for (const Block* b = seg->first; b; prev = b, b = b->next) {
      if (b->seg != seg || b->prev != prev || b->addr != at || b->size == 0) {
        err << "segment " << seg->lease.id << ": broken block list at " << b->addr << "; ";
        break;
      }
      at += b->size;
      if (b->state != BState::kFree && b->state != BState::kUnbacked) ++busy;
      if (b->state != BState::kUnbacked && seg->releasing != (b->state == BState::kReleasing)) {
        err << "block " << b->addr << ": releasing state differs from its segment; ";
      }
      switch (b->state) {
        case BState::kFree: {
          ++free_blocks;
          if (!pool.in_free_set(b)) err << "free block " << b->addr << " is in no free set; ";
          if (prev && BlockPool::mergeable(prev, b)) {
            err << "free block " << b->addr << " not merged; ";
          }
          break;
        }
        case BState::kLive: {
          ++live_blocks;
          in_use += b->size;
          auto it = live.find(b->addr);
          if (it == live.end() || it->second != b) err << "live block " << b->addr << " unknown; ";
          break;
        }
        case BState::kWaiting:
          if (b->pending <= 0) err << "waiting block " << b->addr << " waits for nothing; ";
          break;
        case BState::kHeld:
          held_bytes += b->size;
          if (!graphs.is_held(b)) err << "held block " << b->addr << " not held; ";
          break;
        case BState::kReleasing:
          break;
        case BState::kUnbacked:
          unbacked += b->size;
          if (page == 0 || (b->addr - base) % page != 0 || b->size % page != 0) {
            err << "unbacked block " << b->addr << " is not whole pages; ";
          }
          if (pool.in_free_set(b)) err << "unbacked block " << b->addr << " is in a free set; ";
          break;
      }
    }
    if (unbacked != seg->unbacked) {
      err << "segment " << seg->lease.id << ": unbacked " << unbacked << " != " << seg->unbacked
          << "; ";
    }
    if (at != reinterpret_cast<uintptr_t>(seg->lease.base) + seg->lease.size) {
      err << "segment " << seg->lease.id << ": blocks do not cover it; ";
    }
    if (busy != seg->busy) err << "segment " << seg->lease.id << ": busy count wrong; ";
    bool idle = busy == 0 && !seg->releasing;
    if (idle != (pool.free_segments().count(seg) > 0)) {
      err << "segment " << seg->lease.id << ": free-segment index wrong; ";
    }
  }
  BlockPool::FreeSetCount sets = pool.count_free_sets();
  for (uint64_t i = 0; i < sets.empty_sets; ++i) err << "empty free set kept for a stream; ";
  if (sets.blocks != free_blocks)
    err << "free sets hold " << sets.blocks << " blocks, " << free_blocks << " free; ";
  if (live.size() != live_blocks)
    err << "live index has " << live.size() << " of " << live_blocks << "; ";
  if (in_use != in_use_bytes) err << "in use " << in_use << " != " << in_use_bytes << "; ";
  const uint64_t leased_now = leases.leased_bytes();
  if (leased != leased_now) err << "leased " << leased << " != " << leased_now << "; ";
  if (unbacked_total != leases.unbacked_bytes())
    err << "unbacked " << unbacked_total << " != " << leases.unbacked_bytes() << "; ";
  if (held_bytes != graphs.held_bytes())
    err << "held " << held_bytes << " != " << graphs.held_bytes() << "; ";
  if (!order.pending_count_consistent()) err << "pending count wrong; ";
  if (opt.budget_bytes && leased_now > opt.budget_bytes) err << "over budget; ";
  return err.str();
}

}  // namespace leasehold::torch_plugin
