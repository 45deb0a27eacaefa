#include "tests/engine/recompute_check.h"

#include <memory>
#include <optional>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"

namespace leasehold::engine {
namespace {

using Recompute = nn::TransformerBlock::Recompute;

struct Step {
  std::vector<float> loss;
  std::vector<std::vector<float>> grads;  // every parameter's, in order
  uint64_t kept_bytes = 0;  // allocator bytes alive between forward and backward, over the start
};

Step gpt_step(Device device, Recompute recompute, bool autocast) {
  manual_seed(52);
  auto emb = std::make_shared<nn::Embedding>(64, 64, 48);
  nn::Sequential model;
  model.push_back(emb);
  for (int i = 0; i < 2; ++i) {
    auto block = std::make_shared<nn::TransformerBlock>(64, 4, 0.2, 2);
    block->set_recompute(recompute);
    model.push_back(block);
  }
  model.push_back(std::make_shared<nn::LayerNorm>(64));
  model.push_back(std::make_shared<nn::TiedOutput>(emb));
  model.to(device);
  std::vector<int64_t> tokens, targets;
  for (int64_t i = 0; i < 4 * 40; ++i) {
    tokens.push_back((i * 37 + 11) % 64);
    targets.push_back((i * 53 + 5) % 64);
  }
  Tensor x = from_vector(tokens, {4, 40}).to(device);
  Tensor y = from_vector(targets, {4 * 40}).to(device);
  Tensor step = zeros({}, {DType::Int64, device});

  Step r;
  auto allocator = current_allocator(device);
  // (Counted where memory is handed out and returned, on the host.)
  const uint64_t start = allocator->stats().in_use_bytes;
  Tensor loss;
  {
    StepRandom random(9, step);
    std::optional<AutocastGuard> ac;
    if (autocast) ac.emplace(DType::BFloat16);
    loss = cross_entropy(model(x).reshape({4 * 40, 64}), y);
  }
  r.kept_bytes = allocator->stats().in_use_bytes - start;
  loss.backward();
  r.loss = loss.detach().to(Device::cpu()).to_vector<float>();
  for (const Tensor& p : model.parameters()) {
    r.grads.push_back(p.grad().to(DType::Float32).to(Device::cpu()).to_vector<float>());
  }
  return r;
}

}  // namespace

std::string recompute_mismatch(Device device, bool autocast) {
  const Step kept = gpt_step(device, Recompute::None, autocast);
  uint64_t less_than = kept.kept_bytes;
  for (Recompute r : {Recompute::Mlp, Recompute::Block}) {
    const std::string mode = r == Recompute::Mlp ? "MLPs recomputed" : "whole blocks recomputed";
    const Step again = gpt_step(device, r, autocast);
    if (again.loss != kept.loss) return mode + ": the loss differs";
    if (again.grads.size() != kept.grads.size()) return mode + ": another number of gradients";
    for (size_t i = 0; i < kept.grads.size(); ++i) {
      if (again.grads[i] != kept.grads[i]) {
        return mode + ": parameter " + std::to_string(i) + "'s gradient differs";
      }
    }
    if (again.kept_bytes >= less_than) {
      return mode + ": " + std::to_string(again.kept_bytes) + " bytes kept, not under " +
             std::to_string(less_than);
    }
    less_than = again.kept_bytes;
  }
  if (less_than * 2 >= kept.kept_bytes) {
    return "whole blocks recomputed keep " + std::to_string(less_than) +
           " bytes, not under half of " +
           std::to_string(kept.kept_bytes);
  }
  return "";
}

}  // namespace leasehold::engine
