// What the transformer blocks of a job's model recompute in backward
// instead of keeping (engine/nn.h: TransformerBlock::Recompute), for a job
// over its memory budget: nothing at first; then one step more after each
// step in which the budget made the spill manager take saved tensors off
// the device (once its CUDA graph was tried, where it may be: the graph's
// arena may fit where the step op by op spills), or whose CUDA graph's
// arena did not fit (the graph is then traced again at once): first the MLP of one
// block after another, from the first block on (the oldest activations,
// those spilling picks first), then whole blocks but their attention
// kernel (its output kept) in the same order, then whole blocks; the last
// block goes through the same levels only then. Its backward comes first,
// so what it would recompute is made again at once as backward starts,
// about what it would have kept, and the step's peak is there (for the
// GPT job): recomputing it frees only what it keeps between its forward
// and the loss. Recomputing a GPT block's MLP costs about a
// third of its forward and frees more than half of its activations; the
// whole block but its attention frees two thirds of the rest (all but
// the block's input and the attention's output) for three fifths of the
// rest's compute; the attention's output goes last, at the
// most compute per byte. Moving the same activations to host memory and
// back costs several steps on a PCIe link, so recomputing comes first
// and spilling takes what is left once every block recomputes. But where
// blocks may keep their inputs in host memory (a CUDA job that may spill
// to a host tier: agent/spill/host_tier.h), a block that comes to
// recompute from its input (whole, but its attention or not) keeps that
// input there from the same step on, all but the last two blocks
// (engine/host_offload.h): one tensor a block, whose bytes are planned
// over the host link while the step's kernels run (the step is still one
// CUDA graph, where spilling moves bytes op by op and waits for them),
// costs less than the next block's recompute. At 50% of the GPT job's
// peak the policy then ends at three MLPs and two blocks but their
// attention, both inputs in host memory: 90.8-91.5% of its unconstrained
// speed in six runs on two H200s, where recomputing alone ended at two
// MLPs and three blocks but their attention: 90.2-90.5% in four. Then
// come the MLPs in slices (below), and last the job's last step (its optimizer's state moves to host memory,
// an eighth at a time, until the step fits, optim.h: move_state_to_host;
// the update then reads that part over the link, which costs less than a
// step that spills every block's input: all of the GPT's state, about a
// third of its step),
// for a model with blocks only (a model without them spills alone, as it
// did before blocks existed). A step that runs out of memory outright
// (its working set over the budget with everything spilled) takes one
// step more and runs again (run_step).
//
// Once every block recomputes whole (and, where they may, the inputs of
// all but the last two are in host memory: the last block's never goes,
// backward needs it first and it would come back at once; the one before
// it comes later, below), what is left frees memory without recomputing
// more, one step at a time, in this order:
//
// - A block's MLP in kMlpParts (two) slices of the batch, one at a time
//   (TransformerBlock::set_mlp_parts), one block more at each step, from
//   the last block on: a whole block's backward holds the step's peak
//   there (a GPT block's MLP: the GELU's input, its output and its
//   gradient, 48 MiB each, live at once), and slices keep half of them at
//   a time, for products of half the rows and no bytes over the host link;
//   the last block's backward comes first, while the most of the other
//   blocks' inputs are still held (on the device, or fetched back). The
//   weights' gradients are then sums over the slices, within rounding of
//   the whole batch's (the steps before keep the bits). (Four slices kept less again, but their
//   products and launches cost the GPT job 7 points of its speed at 30%
//   of its peak.)
// - The input of the block before the last: backward fetches it as soon
//   as it starts, so it is off the device only while the last block runs
//   again, and its copies are not hidden. Taken before the slices, it
//   cost the GPT job at 25% of its peak 2.2 points of its speed (71.8%
//   of unconstrained against 74.0%, with every MLP in slices either way).
// - The job's last step (above).
//
// Inputs in host memory cost less than slices: at 30% of the GPT job's
// peak, three blocks' inputs in host memory and no slices ran at 81.6% of
// its unconstrained speed, every MLP in slices and no inputs out at 74.8%.
// Each slice after the first adds its gradients to the sums so far in the
// kernels that make them (engine/autograd.h: gradient_to_add_into).
//
// Where inputs may go to host memory, the halves that come then (below)
// are the whole block in halves
// (Recompute::BlockInHalves): one input a block, whose backward makes the
// MLP's input again, for one attention half's forward instead of the
// MLP's input over the link.
//
// A whole block recomputed in backward (but its attention or not) holds
// both halves' activations at once there. Where that is over the budget
// (the step's spilling took tensors saved during backward, or a step ran
// out of memory during a recomputed segment's backward), the blocks
// recompute their two halves apart from then on instead
// (Recompute::Halves: a whole block's compute, one half's activations at
// a time): those recomputing whole go to halves at once, as one step, and
// later steps take MLP-only blocks to halves rather than further. Once
// every block recomputes whole (the inputs of all but the last two in
// host memory, where they may go), the MLPs in slices, the block before
// the last's input and the last step come first (in that order, above): slices free memory in
// backward without keeping more in forward, the others in forward and
// backward alike, where halves keep more in forward (the residual stream between
// the halves, in float32). Where inputs may go to host memory, halves
// also wait until every block recomputes whole: halves would send twice
// the bytes over the link (two inputs a block). Otherwise
// nothing goes back to being kept within a run (a budget, once hit, is
// hit again). The job also takes a
// step when its steps fit but their CUDA graph does not
// (graphed_steps.h): a graph's step, launched once, beats a step op by op
// that keeps a little more.
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
  // whole (or in halves; before halves, see the top), taken again at each
  // step more until it frees nothing (the job's moves its optimizer's
  // state to host memory an eighth at a time); returns whether it freed
  // anything. `last_step_said` (may be empty): what describe() says of it
  // once taken ("and the optimizer's state is in host memory" if empty).
  // `offload`: whether blocks may keep their inputs in host memory (see
  // the top).
  RecomputePolicy(const engine::nn::Module& model, std::shared_ptr<spill::SpillManager> spill,
                  std::function<bool()> last_step = {}, bool offload = false,
                  std::function<std::string()> last_step_said = {});

  // Why after_step() took one step more, if it did.
  enum class Step { None, Spilled, WorkingSetSpilled, GraphDidNotFit };
  // What a step that ran op by op showed.
  struct Outcome {
    bool spilled = false;              // saved tensors left the device for the budget
    bool working_set_spilled = false;  // among them, some saved during backward
    bool graph_did_not_fit = false;    // its CUDA graph's arena did not fit (GraphedSteps)
  };
  // After a step that ran op by op, once SpillManager::end_step() has
  // ended it (before the next one's forward): one step more when that step
  // evicted saved tensors (the spill manager's last step; backward's own
  // ones make the blocks recompute in halves), or else when its CUDA
  // graph's arena did not fit beside what else lives (`graph_did_not_fit`,
  // which the caller then retries); says why it took one.
  Step after_step(bool graph_did_not_fit = false);
  // The same for an outcome given (the spill manager's own is ignored).
  Step after(const Outcome& step);
  // One step more, whatever the last step did; false when every block
  // recomputes whole (or in halves) already and the last step frees
  // nothing more. `working_set_over`: the step's backward needed more
  // than the budget (see the top).
  bool tighten(bool working_set_over = false);
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
  // Blocks that recompute whole but their attention (its output kept).
  int but_attention() const {
    return count(engine::nn::TransformerBlock::Recompute::BlockButAttention);
  }
  // Blocks that recompute their two halves apart, and those that
  // recompute whole in halves (keeping their input alone).
  int halves() const { return count(engine::nn::TransformerBlock::Recompute::Halves); }
  int blocks_in_halves() const {
    return count(engine::nn::TransformerBlock::Recompute::BlockInHalves);
  }
  // Blocks set to keep their input in host memory; those whose input went
  // there; and those whose input found no room there at least once (the
  // job's host tier full: host_offload.h), staying on the device.
  int offloaded() const;
  int offloaded_in_host_memory() const;
  int offloads_short_of_memory() const;
  // In how many slices of the batch the blocks run their MLPs again (see
  // the top): kMlpParts once any block's MLP runs so, else 1.
  int mlp_slices() const;
  bool mlps_sliced() const { return mlp_slices() > 1; }
  // Blocks that run their MLP again in slices (from the last block on).
  int sliced_mlps() const;
  static constexpr int64_t kMlpParts = 2;
  // Whether the last step was taken and freed something, and how many
  // times.
  bool took_last_step() const { return last_steps_ > 0; }
  int last_steps() const { return last_steps_; }
  // "of 6 transformer blocks, 3 recompute their MLP and 3 the whole block
  // in backward" (", 2 its two halves apart" when any do), and the last
  // step when taken: for the job's log.
  std::string describe() const;
  // Why after_step() took a step, for the job's log: "the step spilled
  // 72.00 MiB to stay within the memory budget" (the bytes when the spill
  // manager is known), "the step's CUDA graph did not fit in memory".
  std::string reason(Step why) const;

 private:
  int count(engine::nn::TransformerBlock::Recompute r) const;
  // The last step, once more; whether it freed anything (once it frees
  // nothing it is not asked again).
  bool take_last_step();
  // What comes once every block recomputes whole (or in halves; see the
  // top): the inputs of all blocks but the last two to host memory, the
  // MLPs in slices, the input of the block before the last, the last
  // step; one of them a step. False when none is left.
  bool after_every_block_whole();
  // The input to host memory of the first block but the last that
  // recomputes from it and keeps it on the device (once every block
  // recomputes whole, the block before the last's: the others' went with
  // their recompute); false when none is left.
  bool offload_next();
  // Block i, now recomputing from its input, keeps it in host memory
  // where inputs may go (not the last two blocks'). (Not a step of its own.)
  void offload_input(size_t i);
  // The blocks whose inputs may go to host memory as they come to
  // recompute from them, [0, this): all but the last two (see the top).
  size_t offloaded_with_recompute() const;
  // The last block that recomputes and runs its MLP whole runs it again in
  // kMlpParts slices (see the top); false when none is left.
  bool slice_next_mlp();
  std::vector<engine::nn::TransformerBlock*> blocks_;
  std::shared_ptr<spill::SpillManager> spill_;
  std::function<bool()> last_step_;
  std::function<std::string()> last_step_said_;
  bool last_step_done_ = false;  // it freed nothing when last asked
  int last_steps_ = 0;           // the times it freed something
  bool offload_ = false;
  // What blocks go to where a whole block's backward is over the budget:
  // the whole block in halves where inputs may go to host memory (the
  // halves' second input would cross the link), else the halves.
  engine::nn::TransformerBlock::Recompute halves_;
  bool whole_blocks_fit_ = true;  // until a working set over the budget (see the top)
};

}  // namespace leasehold
