// What the transformer blocks of a job's model recompute in backward
// instead of keeping (engine/nn.h: TransformerBlock::Recompute), for a job
// over its memory budget: nothing at first; then, after each step in which
// the budget made the spill manager take saved tensors off the device, one
// step more: first the GELU output of one block's MLP after another, from
// the first block on (the oldest activations, those spilling picks
// first), then the MLPs in the same order, then whole blocks. Making a GPT
// block's GELU output again costs one elementwise write and frees a
// quarter of its activations; recomputing its MLP costs about a third of
// its forward and frees more than half; the whole block costs the rest
// for the rest; moving the
// same activations to host memory and back costs several steps on a PCIe
// link, so recomputing comes first and spilling takes what is left once
// every block recomputes. Nothing goes back to being kept within a run (a
// budget, once hit, is hit again). The job also takes a step when its
// steps fit but their CUDA graph does not (graphed_steps.h): a graph's
// step, launched once, beats a step op by op that keeps a little more.
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
  // `gelu_outputs`: whether the GELU-output level frees anything, which it
  // does only where the model runs under autocast (ops.h: mlp_gelu); when
  // not, the policy skips it.
  RecomputePolicy(const engine::nn::Module& model, std::shared_ptr<spill::SpillManager> spill,
                  bool gelu_outputs);

  // After a step, once SpillManager::end_step() has ended it (before the
  // next one's forward): one step more when that step evicted saved
  // tensors; returns whether it took one.
  bool after_step();
  // One step more, whatever the last step did; false when every block
  // recomputes whole already.
  bool tighten();

  int blocks() const { return static_cast<int>(blocks_.size()); }
  // Blocks that make only their GELU output again, those that recompute
  // their MLP, and those that recompute whole.
  int gelu_outputs() const { return count(engine::nn::TransformerBlock::Recompute::GeluOutput); }
  int mlps() const { return count(engine::nn::TransformerBlock::Recompute::Mlp); }
  int whole() const { return count(engine::nn::TransformerBlock::Recompute::Block); }

 private:
  int count(engine::nn::TransformerBlock::Recompute r) const;
  std::vector<engine::nn::TransformerBlock*> blocks_;
  std::shared_ptr<spill::SpillManager> spill_;
  bool gelu_outputs_;
};

}  // namespace leasehold
