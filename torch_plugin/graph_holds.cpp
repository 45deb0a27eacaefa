#include "torch_plugin/graph_holds.h"

#include <vector>

namespace leasehold::torch_plugin::detail {

void GraphHolds::hold(Block* b) {
  b->state = BState::kHeld;
  held_.insert(b);
  held_bytes_ += b->size;
}

void GraphHolds::return_held(std::unique_lock<std::mutex>& lk) {
  if (held_.empty()) return;
  for (StreamId s : captures_) {
    if (streams_.capturing(s)) return;
  }
  captures_.clear();
  std::vector<StreamId> targets(order_.known_streams().begin(), order_.known_streams().end());
  for (StreamId s : targets) {
    if (streams_.capturing(s)) return;  // a new capture began
  }
  std::vector<Block*> blocks(held_.begin(), held_.end());
  reach_now(lk, streams_, targets);
  for (Block* b : blocks) {
    held_.erase(b);
    held_bytes_ -= b->size;
    pool_.make_free(b, true);
  }
}

}  // namespace leasehold::torch_plugin::detail
