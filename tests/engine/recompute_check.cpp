#include "tests/engine/recompute_check.h"

#include <memory>
#include <optional>

#include "agent/engine/allocator.h"
#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"

namespace leasehold::engine {

RecomputeStep gpt_step(Device device, nn::TransformerBlock::Recompute recompute, bool autocast) {
  manual_seed(52);
  auto emb = std::make_shared<nn::Embedding>(64, 64, 48);
  nn::Sequential model;
  model.push_back(emb);
  std::vector<std::shared_ptr<nn::TransformerBlock>> blocks;
  for (int i = 0; i < 2; ++i) {
    blocks.push_back(std::make_shared<nn::TransformerBlock>(64, 4, 0.2, 2));
    blocks.back()->set_recompute(recompute);
    model.push_back(blocks.back());
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

  RecomputeStep r;
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
  // Backward outside the step's random scope and autocast: a recomputed
  // segment brings back the ones it ran in.
  loss.backward();
  r.loss = loss.detach().to(Device::cpu()).to_vector<float>();
  for (const Tensor& p : model.parameters()) {
    r.grads.push_back(p.grad().to(DType::Float32).to(Device::cpu()).to_vector<float>());
  }
  return r;
}

}  // namespace leasehold::engine
