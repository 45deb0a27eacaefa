// Optimisers that update parameters in place with one fused kernel per
// parameter (CPU loop or CUDA kernel). Semantics follow torch.optim.SGD and
// torch.optim.Adam. Parameters without a gradient are skipped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "agent/engine/nn.h"

namespace leasehold::engine::optim {

class Optimizer {
 public:
  explicit Optimizer(nn::NamedTensors params);
  virtual ~Optimizer() = default;
  virtual void step() = 0;
  // Drops every parameter's gradient (the next backward writes fresh ones).
  void zero_grad();
  // State for checkpoints: named tensors on the parameters' devices.
  virtual nn::NamedTensors state() const = 0;
  // Restores state(); throws std::invalid_argument naming a missing or
  // mis-shaped entry.
  virtual void load_state(const nn::NamedTensors& state) = 0;

 protected:
  nn::NamedTensors params_;
};

struct SgdOptions {
  double lr = 0.01, momentum = 0, weight_decay = 0;
};

class SGD final : public Optimizer {
 public:
  SGD(nn::NamedTensors params, SgdOptions options);
  void step() override;
  nn::NamedTensors state() const override;
  void load_state(const nn::NamedTensors& state) override;

 private:
  SgdOptions opt_;
  std::vector<Tensor> momentum_;  // per parameter, allocated on first step
  bool started_ = false;
};

struct AdamOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
};

class Adam final : public Optimizer {
 public:
  Adam(nn::NamedTensors params, AdamOptions options);
  void step() override;
  nn::NamedTensors state() const override;
  void load_state(const nn::NamedTensors& state) override;
  int64_t steps() const { return step_; }

 private:
  AdamOptions opt_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
};

}  // namespace leasehold::engine::optim
