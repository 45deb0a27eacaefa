#include "agent/recompute_policy.h"

namespace leasehold {

namespace nn = engine::nn;
using Recompute = nn::TransformerBlock::Recompute;

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
}

int RecomputePolicy::count(Recompute r) const {
  int n = 0;
  for (const auto* b : blocks_) n += b->recompute() == r;
  return n;
}

RecomputePolicy::Step RecomputePolicy::after_step(bool graph_did_not_fit) {
  // (One step per failure: a step that spilled and whose graph did not fit
  // is one reason to keep less, not two.)
  if (spill_ && spill_->last_step_spilled()) return tighten() ? Step::Spilled : Step::None;
  if (graph_did_not_fit) return tighten() ? Step::GraphDidNotFit : Step::None;
  return Step::None;
}

bool RecomputePolicy::tighten() {
  // The first block that keeps its MLP recomputes it; once none does, the
  // first block not yet recomputed whole is.
  for (Recompute from : {Recompute::None, Recompute::Mlp}) {
    for (auto* b : blocks_) {
      if (b->recompute() == from) {
        b->set_recompute(from == Recompute::None ? Recompute::Mlp : Recompute::Block);
        return true;
      }
    }
  }
  return false;
}

int RecomputePolicy::run_step(
    const std::function<void()>& step, const std::function<bool()>& unchanged,
    const std::function<void(const engine::OutOfMemoryError&)>& retrying) {
  for (int retries = 0;; ++retries) {
    try {
      step();
      return retries;
    } catch (const engine::OutOfMemoryError& e) {
      if (!unchanged() || !tighten()) throw;
      if (retrying) retrying(e);
    }
  }
}

}  // namespace leasehold
