#include "agent/recompute_policy.h"

#include <algorithm>

#include "shared/units.h"

namespace leasehold {

namespace nn = engine::nn;
using Recompute = nn::TransformerBlock::Recompute;
using Offload = nn::TransformerBlock::Offload;

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
                                 std::shared_ptr<spill::SpillManager> spill,
                                 std::function<bool()> last_step, bool offload,
                                 std::function<std::string()> last_step_said)
    : spill_(std::move(spill)),
      last_step_(std::move(last_step)),
      last_step_said_(std::move(last_step_said)),
      offload_(offload),
      halves_(offload ? Recompute::BlockInHalves : Recompute::Halves) {
  collect(model, blocks_);
}

std::string RecomputePolicy::describe() const {
  std::string s = "of " + std::to_string(blocks()) + " transformer blocks, " +
                  std::to_string(mlps()) + " recompute their MLP and " + std::to_string(whole()) +
                  " the whole block";
  if (but_attention()) {
    s += ", " + std::to_string(but_attention()) + " the whole block but its attention,";
  }
  if (halves()) s += ", " + std::to_string(halves()) + " its two halves apart,";
  if (blocks_in_halves()) {
    s += ", " + std::to_string(blocks_in_halves()) + " the whole block in halves,";
  }
  s += " in backward";
  if (const int n = sliced_mlps()) {
    s += n == blocks() - count(Recompute::None)
             ? ", their MLPs"
             : ", the MLPs of the last " + std::to_string(n);
    s += " in " + std::to_string(mlp_slices()) + " slices of the batch at a time";
  }
  if (last_steps_ > 0) {
    s += ", ";
    s += last_step_said_ ? last_step_said_() : "and the optimizer's state is in host memory";
  }
  if (const int n = offloaded()) {
    s += "; " + std::to_string(n) + (n == 1 ? " block keeps its" : " blocks keep their") +
         " input in host memory";
  }
  return s;
}

std::string RecomputePolicy::reason(Step why) const {
  if (why == Step::None) return "nothing spilled or failed to fit";
  if (why == Step::GraphDidNotFit) return "the step's CUDA graph did not fit in memory";
  std::string s = "the step spilled";
  if (spill_) {
    s += ' ';
    s += format_bytes(spill_->last_step_spilled_bytes());
  }
  s += why == Step::WorkingSetSpilled ? ", its backward's own recomputed activations among them"
                                      : " to stay within the memory budget";
  return s;
}

int RecomputePolicy::offloaded() const {
  int n = 0;
  for (const auto* b : blocks_)
    n += b->offload() != Offload::None && b->recompute() != Recompute::None;
  return n;
}

int RecomputePolicy::offloaded_in_host_memory() const {
  int n = 0;
  for (const auto* b : blocks_) n += b->offload_host_bytes() > 0;
  return n;
}

int RecomputePolicy::offloads_short_of_memory() const {
  int n = 0;
  for (const auto* b : blocks_) n += b->offload_short_of_memory();
  return n;
}

int RecomputePolicy::count(Recompute r) const {
  int n = 0;
  for (const auto* b : blocks_) n += b->recompute() == r;
  return n;
}

RecomputePolicy::Step RecomputePolicy::after_step(bool graph_did_not_fit) {
  Outcome o;
  o.spilled = spill_ && spill_->last_step_spilled();
  o.working_set_spilled = spill_ && spill_->last_step_spilled_working_set();
  o.graph_did_not_fit = graph_did_not_fit;
  return after(o);
}

RecomputePolicy::Step RecomputePolicy::after(const Outcome& step) {
  // (One step per failure: a step that spilled and whose graph did not fit
  // is one reason to keep less, not two.)
  if (step.working_set_spilled) return tighten(true) ? Step::WorkingSetSpilled : Step::None;
  if (step.spilled) return tighten() ? Step::Spilled : Step::None;
  if (step.graph_did_not_fit) return tighten() ? Step::GraphDidNotFit : Step::None;
  return Step::None;
}

bool RecomputePolicy::tighten(bool working_set_over) {
  const bool all_whole = whole() + but_attention() == blocks();
  // With inputs that may go to host memory, backward's working set over
  // the budget is no reason for halves before every block recomputes
  // whole (its input gone with it): those free memory in backward too,
  // and halves cost the host link twice the bytes (two inputs per block).
  if (offload_ && !all_whole) working_set_over = false;
  // Every block recomputing whole (but its attention or not), the MLPs
  // in slices, the block before the last's input and the last step come
  // before halves (after_every_block_whole): the
  // halves keep more per block in forward (the residual stream between
  // them, in float32), and what is over the budget may be what forward
  // keeps as much as backward's own working set (at 35% of the GPT job's
  // peak, whole blocks with the optimizer's state on the host fit as a
  // CUDA graph; halves there spill every step).
  if (working_set_over && whole_blocks_fit_ && all_whole && after_every_block_whole()) {
    return true;
  }
  if (working_set_over && whole_blocks_fit_) {
    // Whole blocks (with or without their attention's output) hold both
    // halves' activations in backward: from now on they recompute in
    // halves, those that did whole at once (one step).
    whole_blocks_fit_ = false;
    bool any = false;
    for (auto* b : blocks_) {
      if (b->recompute() == Recompute::Block || b->recompute() == Recompute::BlockButAttention) {
        b->set_recompute(halves_);
        any = true;
      }
    }
    if (any) return true;
  }
  // The first block that keeps its MLP recomputes it; once none does, the
  // first block that recomputes its MLP only recomputes whole but its
  // attention; once none does, the first of those whole (or, from the MLP
  // on, in halves). Under autocast a GPT block but its attention keeps
  // 37 MiB where the whole block keeps 24, and spares two fifths of its
  // attention half's recompute: for the bytes a number of whole blocks
  // frees, blocks but their attention, a sixth more of them, cost less.
  // The last block goes through the same levels once every other block
  // recomputes whole: its backward comes first, so what it would recompute
  // is all made again as backward starts, about what it would have kept,
  // and at the step's peak (there, for the GPT job) it frees next to
  // nothing; it spares only its activations between its forward and the
  // loss.
  const std::pair<Recompute, Recompute> order[] = {
      {Recompute::None, Recompute::Mlp},
      {Recompute::Mlp, whole_blocks_fit_ ? Recompute::BlockButAttention : halves_},
      {Recompute::BlockButAttention, Recompute::Block},
  };
  const size_t others = blocks_.empty() ? 0 : blocks_.size() - 1;
  for (const auto& [first, last] : {std::pair<size_t, size_t>{0, others}, {others, blocks_.size()}}) {
    for (const auto& [from, to] : order) {
      for (size_t i = first; i < last; ++i) {
        if (blocks_[i]->recompute() == from) {
          blocks_[i]->set_recompute(to);
          if (to != Recompute::Mlp) offload_input(i);  // (see the top)
          return true;
        }
      }
    }
  }
  return after_every_block_whole();
}

bool RecomputePolicy::after_every_block_whole() {
  return slice_next_mlp() || offload_next() || take_last_step();
}

bool RecomputePolicy::slice_next_mlp() {
  for (auto it = blocks_.rbegin(); it != blocks_.rend(); ++it) {
    nn::TransformerBlock& b = **it;
    if (b.recompute() != Recompute::None && b.mlp_parts() == 1) {
      b.set_mlp_parts(kMlpParts);
      return true;
    }
  }
  return false;
}

int RecomputePolicy::sliced_mlps() const {
  int n = 0;
  for (const auto* b : blocks_) n += b->recompute() != Recompute::None && b->mlp_parts() > 1;
  return n;
}

int RecomputePolicy::mlp_slices() const {
  int64_t most = 1;
  for (const auto* b : blocks_) most = std::max(most, b->mlp_parts());
  return static_cast<int>(most);
}

size_t RecomputePolicy::offloaded_with_recompute() const {
  return blocks_.size() - std::min<size_t>(blocks_.size(), 2);
}

void RecomputePolicy::offload_input(size_t i) {
  if (!offload_ || i >= offloaded_with_recompute()) return;
  nn::TransformerBlock& b = *blocks_[i];
  if (b.offload() == Offload::None) b.set_offload(Offload::Input);
}

bool RecomputePolicy::offload_next() {
  if (!offload_) return false;
  // (Not the last block: backward needs its input first. Halves with two
  // inputs a block never come where inputs may go: see halves_.)
  const size_t end = blocks_.size() - std::min<size_t>(blocks_.size(), 1);
  for (size_t i = 0; i < end; ++i) {
    nn::TransformerBlock& b = *blocks_[i];
    if (b.recompute() != Recompute::None && b.offload() == Offload::None) {
      b.set_offload(Offload::Input);
      return true;
    }
  }
  return false;
}

bool RecomputePolicy::take_last_step() {
  if (blocks_.empty() || !last_step_ || last_step_done_) return false;
  if (!last_step_()) {
    last_step_done_ = true;
    return false;
  }
  ++last_steps_;
  return true;
}

int RecomputePolicy::run_step(
    const std::function<void()>& step, const std::function<bool()>& unchanged,
    const std::function<void(const engine::OutOfMemoryError&)>& retrying) {
  for (int retries = 0;; ++retries) {
    try {
      step();
      return retries;
    } catch (const engine::OutOfMemoryError& e) {
      // (A permanent one, a tensor larger than the whole budget, stays so.)
      // (Short during a recomputed segment's backward: whole blocks would
      // need more there at once than halves.)
      const bool working_set = spill_ && spill_->last_shortfall_in_recomputed_backward();
      if (e.permanent() || !unchanged() || !tighten(working_set)) throw;
      if (retrying) retrying(e);
    }
  }
}

}  // namespace leasehold
