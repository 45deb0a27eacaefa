// Which transformer blocks of a job's model run again in backward instead
// of keeping their activations (engine/recompute.h), for a job over its
// memory budget: none at first, then, after each step in which the budget
// made the spill manager take saved tensors off the device, one block
// more, from the first on (the oldest activations, those spilling picks
// first). Recomputing a GPT block costs about a third of its step;
// moving its activations to host memory and back costs several of its
// steps on a PCIe link, so recomputing comes first and spilling takes what
// is left once every block recomputes. Blocks never go back to keeping
// their activations within a run (a budget, once hit, is hit again).
//
// Thread safety: the job's thread only.
#pragma once

#include <memory>
#include <vector>

#include "agent/engine/nn.h"
#include "agent/spill/spill_manager.h"

namespace leasehold {

class RecomputePolicy {
 public:
  // The blocks are `model`'s TransformerBlocks, at any depth, in forward
  // order. `spill` may be null (no budget to keep: nothing ever recomputes).
  RecomputePolicy(const engine::nn::Module& model, std::shared_ptr<spill::SpillManager> spill);

  // After a step (before the next one's forward): turns the next block on
  // when that step evicted saved tensors; returns whether it did.
  bool after_step();

  int recomputing() const { return on_; }
  int blocks() const { return static_cast<int>(blocks_.size()); }

 private:
  std::vector<engine::nn::TransformerBlock*> blocks_;
  std::shared_ptr<spill::SpillManager> spill_;
  uint64_t evictions_seen_ = 0;
  int on_ = 0;
};

}  // namespace leasehold
