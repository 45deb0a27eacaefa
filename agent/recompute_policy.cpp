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
                                 std::shared_ptr<spill::SpillManager> spill, bool gelu_outputs)
    : spill_(std::move(spill)), gelu_outputs_(gelu_outputs) {
  collect(model, blocks_);
}

int RecomputePolicy::count(Recompute r) const {
  int n = 0;
  for (const auto* b : blocks_) n += b->recompute() == r;
  return n;
}

bool RecomputePolicy::after_step() {
  if (!spill_) return false;
  return spill_->last_step_spilled() && tighten();
}

bool RecomputePolicy::tighten() {
  // The first block at the lowest level goes one level up.
  std::vector<Recompute> levels{Recompute::None, Recompute::GeluOutput, Recompute::Mlp,
                                Recompute::Block};
  if (!gelu_outputs_) levels.erase(levels.begin() + 1);
  for (size_t level = 0; level + 1 < levels.size(); ++level) {
    for (auto* b : blocks_) {
      if (b->recompute() == levels[level]) {
        b->set_recompute(levels[level + 1]);
        return true;
      }
    }
  }
  return false;
}

}  // namespace leasehold
