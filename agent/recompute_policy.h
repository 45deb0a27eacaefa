// What the transformer blocks of a job's model recompute in backward
// instead of keeping (engine/nn.h: TransformerBlock::Recompute), for a job
// over its memory budget: nothing at first; then, after each step in which
// the budget made the spill manager take saved tensors off the device, one
// step more: first the MLP of one block after another, from the first
// block on (the oldest activations, those spilling picks first), then
// whole blocks in the same order. Recomputing a GPT block's MLP costs
// about a third of its forward and frees more than half of its
// activations; the whole block costs the rest for the rest; moving the
// same activations to host memory and back costs several steps on a PCIe
// link, so recomputing comes first and spilling takes what is left once
// every block recomputes. Then one step is left: the job's last (its
// optimizer's state moves to host memory, optim.h: move_state_to_host;
// the update then reads it over the link, which costs less than a step
// that spills every block's input), for a model with blocks only (a
// model without them spills alone, as it did before blocks existed). A
// step that runs out of memory outright (its working set over the budget
// with everything spilled) takes one step more and runs again (run_step).
// Nothing goes back to being kept within a run (a budget, once hit, is hit
// again). The job also takes a step when its
// steps fit but their CUDA graph does not (graphed_steps.h): a graph's
// step, launched once, beats a step op by op that keeps a little more.
//
// Thread safety: the job's thread only.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/nn.h"
#include "agent/spill/spill_manager.h"

namespace leasehold {

class RecomputePolicy {
 public:
  // The blocks are `model`'s TransformerBlocks, at any depth, in forward
  // order. `spill` may be null (nothing spills: only a CUDA graph that did
  // not fit makes the blocks recompute).
  // `last_step` (may be empty): the step after every block recomputes
  // whole, taken once; returns whether it freed anything.
  RecomputePolicy(const engine::nn::Module& model, std::shared_ptr<spill::SpillManager> spill,
                  std::function<bool()> last_step = {});

  // Why after_step() took one step more, if it did.
  enum class Step { None, Spilled, GraphDidNotFit };
  // After a step that ran op by op, once SpillManager::end_step() has
  // ended it (before the next one's forward): one step more when that step
  // evicted saved tensors, or else when its CUDA graph's arena did not fit
  // beside what else lives (`graph_did_not_fit`: GraphedSteps's, which the
  // caller then retries); says why it took one.
  Step after_step(bool graph_did_not_fit = false);
  // One step more, whatever the last step did; false when every block
  // recomputes whole already and the last step was taken (or did nothing).
  bool tighten();
  // Runs `step`. When it runs out of memory (engine::OutOfMemoryError: the
  // budget held, and nothing more could spill; not a permanent one, a
  // tensor larger than the whole budget) and `unchanged()` says the
  // failed attempt changed nothing a step reads (the job's test: the
  // optimizer's count is where it was, so no parameter moved; the
  // gradients are zeroed at each step's start), takes one step more and
  // runs it again, for as long as one is left; then the error stands. A
  // budget under what the first steps keep (they recompute little yet) is
  // thus met by a later step of the policy instead of ending the job.
  // `retrying` (may be empty) hears of each error before its step runs
  // again, the policy's step taken. Returns how many times it ran `step`
  // again.
  int run_step(const std::function<void()>& step, const std::function<bool()>& unchanged,
               const std::function<void(const engine::OutOfMemoryError&)>& retrying = {});

  int blocks() const { return static_cast<int>(blocks_.size()); }
  // Blocks that recompute their MLP only, and those that recompute whole.
  int mlps() const { return count(engine::nn::TransformerBlock::Recompute::Mlp); }
  int whole() const { return count(engine::nn::TransformerBlock::Recompute::Block); }
  // Whether the last step was taken and freed something.
  bool took_last_step() const { return last_step_freed_; }
  // "of 6 transformer blocks, 3 recompute their MLP and 3 the whole block
  // in backward", and the last step when taken: for the job's log.
  std::string describe() const;

 private:
  int count(engine::nn::TransformerBlock::Recompute r) const;
  std::vector<engine::nn::TransformerBlock*> blocks_;
  std::shared_ptr<spill::SpillManager> spill_;
  std::function<bool()> last_step_;
  bool last_step_taken_ = false, last_step_freed_ = false;
};

}  // namespace leasehold
