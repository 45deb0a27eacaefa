#include "agent/recompute_policy.h"

namespace leasehold {

namespace nn = engine::nn;

namespace {

void collect(const nn::Module& m, std::vector<nn::TransformerBlock*>& out) {
  for (const auto& child : m.children()) {
    if (auto* block = dynamic_cast<nn::TransformerBlock*>(child.get())) {
      out.push_back(block);
    } else {
      collect(*child, out);
    }
  }
}

}  // namespace

RecomputePolicy::RecomputePolicy(const nn::Module& model,
                                 std::shared_ptr<spill::SpillManager> spill)
    : spill_(std::move(spill)) {
  collect(model, blocks_);
  for (auto* b : blocks_) on_ += b->recomputes();
}

bool RecomputePolicy::after_step() {
  if (!spill_) return false;
  const uint64_t evictions = spill_->counters().evictions;
  const bool evicted = evictions > evictions_seen_;
  evictions_seen_ = evictions;
  if (!evicted || on_ == blocks()) return false;
  // (The first blocks not yet on: any set on from the start are skipped.)
  for (auto* b : blocks_) {
    if (!b->recomputes()) {
      b->set_recompute(true);
      ++on_;
      return true;
    }
  }
  return false;
}

}  // namespace leasehold
