// Optimisers that update parameters in place with one fused kernel per
// parameter (CPU loop or CUDA kernel). Semantics follow torch.optim.SGD,
// torch.optim.Adam and torch.optim.AdamW. Parameters without a gradient are
// skipped. Also gradient-norm clipping and the warm-up/cosine schedule of
// GPT training.
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
  // The learning rate of the next step (a schedule sets it before each).
  virtual double lr() const = 0;
  // REQUIRES: lr > 0 (throws std::invalid_argument otherwise).
  virtual void set_lr(double lr) = 0;

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
  double lr() const override { return opt_.lr; }
  void set_lr(double lr) override;

 private:
  SgdOptions opt_;
  std::vector<Tensor> momentum_;  // per parameter, allocated on first step
  bool started_ = false;
};

struct AdamOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  // AdamW: weight decay shrinks the parameter instead of adding to the
  // gradient.
  bool decoupled = false;
  // Weight decay only on parameters of two or more dimensions (weight
  // matrices and embeddings; not biases or norm gains), as GPT training
  // groups them.
  bool decay_matrices_only = false;
};

class Adam final : public Optimizer {
 public:
  Adam(nn::NamedTensors params, AdamOptions options);
  void step() override;
  nn::NamedTensors state() const override;
  void load_state(const nn::NamedTensors& state) override;
  double lr() const override { return opt_.lr; }
  void set_lr(double lr) override;
  int64_t steps() const { return step_; }

 private:
  AdamOptions opt_;
  std::vector<Tensor> m_, v_;
  int64_t step_ = 0;
};

// Scales every gradient of `params` by min(1, max_norm / (norm + 1e-6)),
// where norm is the 2-norm of all of them together (torch.nn.utils.
// clip_grad_norm_). Returns that norm as a one-element tensor on the
// gradients' device, computed there: clipping never makes the host wait.
// Parameters without a gradient are skipped; an undefined tensor is
// returned when none has one. REQUIRES: max_norm > 0; gradients on one
// device and of one dtype.
Tensor clip_grad_norm(const nn::NamedTensors& params, double max_norm);

// Learning rate at step `step` (0-based): linear warm-up from lr/warmup to
// lr over the first `warmup` steps, then a cosine from lr down to min_lr at
// step `total`, min_lr after (nanoGPT's schedule).
struct CosineSchedule {
  double lr = 1e-3, min_lr = 1e-4;
  int64_t warmup = 0, total = 1;
  double at(int64_t step) const;
};

}  // namespace leasehold::engine::optim
