// Blocks kept aside for CUDA graphs (internal to the block cache:
// block_cache.h states the rules). A captured graph may be replayed later,
// on any stream, against every block it used, so a block allocated or freed
// during a capture is never reused while a graph might still touch it. The
// cache cannot see a program drop its graphs: it relies on empty_cache()
// being called only after they are gone (docs/torch-plugin.md), and frees
// the held blocks there, once no capture is under way and every stream it
// knows reached an event recorded at that moment. Conservative, but simple.
//
// Thread safety: none; the cache's mutex guards it. return_held releases the
// cache's lock while it waits and holds it again on return and on a throw.
#pragma once

#include <cstdint>
#include <mutex>
#include <unordered_set>

#include "torch_plugin/block_cache.h"
#include "torch_plugin/block_pool.h"
#include "torch_plugin/stream_order.h"

namespace leasehold::torch_plugin::detail {

class GraphHolds {
 public:
  // All three must outlive it.
  GraphHolds(StreamOps& streams, BlockPool& pool, StreamOrder& order)
      : streams_(streams), pool_(pool), order_(order) {}
  GraphHolds(const GraphHolds&) = delete;
  GraphHolds& operator=(const GraphHolds&) = delete;

  // Notes that `stream` was seen capturing: held blocks stay held while it
  // still is.
  void saw_capture(StreamId stream) { captures_.insert(stream); }
  // Keeps freed block `b` aside (kHeld): reused by no stream until
  // return_held. Also where a block goes whose users' progress cannot be
  // followed (an event failed to record).
  void hold(Block* b);
  // Returns the held blocks to the pool as ready blocks once no capture
  // seen is under way and every stream known so far reached an event
  // recorded now (graph replays included). Does nothing while a capture
  // is under way. Throws what StreamOps throws, the blocks still held.
  void return_held(std::unique_lock<std::mutex>& lk);

  bool is_held(const Block* b) const { return held_.count(const_cast<Block*>(b)) > 0; }
  uint64_t held_bytes() const { return held_bytes_; }

 private:
  StreamOps& streams_;
  BlockPool& pool_;
  StreamOrder& order_;
  std::unordered_set<Block*> held_;        // kHeld blocks
  std::unordered_set<StreamId> captures_;  // streams seen capturing
  uint64_t held_bytes_ = 0;
};

}  // namespace leasehold::torch_plugin::detail
