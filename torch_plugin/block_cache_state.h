// What a BlockCache's mutex guards (internal to the cache: block_cache.h is
// the interface and states the rules). The cache is made of four parts,
// each with one job:
//   BlockPool      (block_pool.h)      segments and free blocks: best fit,
//                                      split, merge;
//   StreamOrder    (stream_order.h)    when freed blocks become reusable by
//                                      other streams: events, migrations,
//                                      record_stream users;
//   GraphHolds     (graph_holds.h)     blocks kept aside for CUDA graphs;
//   SegmentLeases  (segment_leases.h)  leases in and out within the budget.
// block_cache.cpp ties them together (the allocation policy, free, trim,
// statistics) and indexes the blocks handed out; block_cache_check.cpp
// checks the invariants that span the parts.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

#include "torch_plugin/block_cache.h"
#include "torch_plugin/block_pool.h"
#include "torch_plugin/graph_holds.h"
#include "torch_plugin/segment_leases.h"
#include "torch_plugin/stream_order.h"

namespace leasehold::torch_plugin {

struct BlockCache::State {
  State(LeaseSource& l, StreamOps& s, const BlockCacheOptions& o)
      : opt(o),
        streams(s),
        pool(o),
        order(s, pool),
        graphs(s, pool, order),
        leases(l, s, pool, o) {}

  const BlockCacheOptions& opt;
  StreamOps& streams;
  // Declared in dependency order: each part refers to those above it.
  detail::BlockPool pool;
  detail::StreamOrder order;
  detail::GraphHolds graphs;
  detail::SegmentLeases leases;

  std::unordered_map<uintptr_t, detail::Block*> live;  // blocks handed out, by address

  // Counters of allocate() and free(); the parts keep the others, and
  // BlockCache::stats() gathers them.
  uint64_t in_use_bytes = 0;  // in blocks handed out now (rounded sizes)
  uint64_t peak_in_use_bytes = 0;
  uint64_t allocations = 0;         // successful allocations
  uint64_t cache_hits = 0;          // ... of them served without a new lease
  uint64_t failed_allocations = 0;  // OutOfMemory thrown

  // The allocation policy (block_cache.cpp): `size` is `bytes` rounded to
  // the granularity. REQUIRES: lk holds the cache's mutex; it is released
  // while leasing or waiting and held again on return and on a throw.
  void* allocate(std::unique_lock<std::mutex>& lk, uint64_t bytes, uint64_t size, bool small,
                 StreamId stream, bool capturing);
  // Hands free block `b` out for `size` bytes and counts it.
  void* hand_out(detail::Block* b, uint64_t size, StreamId stream, bool capturing, bool hit);
  // "" when the invariants hold, else what is wrong (block_cache_check.cpp).
  std::string check() const;
};

}  // namespace leasehold::torch_plugin
