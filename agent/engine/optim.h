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
#include "kernels/optim.h"

namespace leasehold::engine::optim {

// The learning rate of each step (kernels/optim.h): constant, or warm-up
// then cosine decay.
using LrSchedule = kernels::LrSchedule;

class Optimizer {
 public:
  // `lr`: the schedule's rate while no schedule is set.
  Optimizer(nn::NamedTensors params, double lr);
  virtual ~Optimizer() = default;
  // One update: advances the step counter, then updates every parameter
  // that has a gradient. Nothing is read back to the host, so a step
  // captured as a CUDA graph replays it.
  void step();
  // Drops every parameter's gradient (the next backward writes fresh ones).
  void zero_grad();
  // State for checkpoints: named tensors on the parameters' devices (in
  // host memory for the parameters whose state move_state_to_host() moved
  // there).
  virtual nn::NamedTensors state() const = 0;
  // Restores state(); throws std::invalid_argument naming a missing or
  // mis-shaped entry.
  virtual void load_state(const nn::NamedTensors& state) = 0;

  // The number of updates made so far: one int64 on the parameters'
  // device, which the update kernels read where they run (the learning
  // rate and Adam's bias corrections come from it there) and which
  // StepRandom mixes into a step's random numbers.
  const Tensor& step_counter() const { return steps_; }
  // The same, read back (waits for the device).
  int64_t steps() const;
  // Sets the count (a run resumed after `n` steps).
  void set_steps(int64_t n);
  // The learning rate of the next step (waits for the device).
  double lr() const;
  // Sets a constant rate; REQUIRES: lr > 0 (throws std::invalid_argument).
  void set_lr(double lr);
  // Sets the rate of every step; REQUIRES: its rates positive.
  void set_schedule(const LrSchedule& schedule);
  // Keeps the state of GPU parameters (Adam's moments) in page-locked host
  // memory from now on (allocator.h: pinned_host_allocator), where the
  // update kernels read and write it over the host link: device memory
  // for a job whose budget cannot hold the state beside a step's working
  // set (AdamW's is twice the parameters), for an update bound by the link
  // (the GPT's 86 MB read and written each step, about 2 ms). Moves the
  // state of whole parameters, in their order, those whose state is still
  // on the device, until at least `at_least_bytes` of state moved (all of
  // it by default): part of it, so that an update reads over the link only
  // what the device cannot hold. The update's results are the same bits,
  // and a step stays capturable as a CUDA graph. Returns whether it moved
  // any: false where it cannot (no GPU parameters, a build without CUDA,
  // an optimizer without such state), all of it is there already, or the
  // host memory is short (a job's host tier full, allocator.h:
  // PinnedHostGuard: a warning says so, and the state stays where it was).
  // (State not made yet, SGD's momentum before its first update, is made
  // in host memory now, zero, as that update would make it; Adam makes its
  // moments with the optimizer.) load_state() puts each
  // parameter's state where its state is.
  // REQUIRES (both): no captured CUDA graph holds the state's addresses
  // (the job forgets its step's graph first).
  bool move_state_to_host(uint64_t at_least_bytes = UINT64_MAX) {
    return move_state(at_least_bytes);
  }
  // The bytes of state the GPU parameters have, wherever it is (or will
  // have, at their first update: SGD's momentum), and those of it in host
  // memory.
  virtual uint64_t gpu_parameters_state_bytes() const { return 0; }
  virtual uint64_t host_state_bytes() const { return 0; }

 protected:
  virtual void update() = 0;
  // move_state_to_host's work (see there): an optimizer with state.
  virtual bool move_state([[maybe_unused]] uint64_t at_least_bytes) { return false; }
  const LrSchedule& schedule() const { return schedule_; }
  // Where the update kernels read the step's number.
  const int64_t* step_pointer() const { return steps_.data<int64_t>(); }

  nn::NamedTensors params_;

 private:
  LrSchedule schedule_;
  Tensor steps_;
};

struct SgdOptions {
  double lr = 0.01, momentum = 0, weight_decay = 0;
};

class SGD final : public Optimizer {
 public:
  SGD(nn::NamedTensors params, SgdOptions options);
  nn::NamedTensors state() const override;
  void load_state(const nn::NamedTensors& state) override;

 private:
  void update() override;
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
  nn::NamedTensors state() const override;
  void load_state(const nn::NamedTensors& state) override;
  uint64_t gpu_parameters_state_bytes() const override;
  uint64_t host_state_bytes() const override;

 private:
  void update() override;
  bool move_state(uint64_t at_least_bytes) override;
  // Zeroed state for parameter i: on its device, or in host memory (see
  // above).
  Tensor new_state(size_t i) const;
  // The bytes of parameter i's state (its two moments).
  uint64_t state_bytes(size_t i) const;
  AdamOptions opt_;
  std::vector<Tensor> m_, v_;
  std::vector<char> on_host_;  // per parameter: its state in host memory
};

// Scales every gradient of `params` by min(1, max_norm / (norm + 1e-6)),
// where norm is the 2-norm of all of them together (torch.nn.utils.
// clip_grad_norm_). Returns that norm as a one-element tensor on the
// gradients' device, computed there: clipping never makes the host wait.
// Parameters without a gradient are skipped; an undefined tensor is
// returned when none has one. REQUIRES: max_norm > 0; gradients on one
// device and of one dtype.
Tensor clip_grad_norm(const nn::NamedTensors& params, double max_norm);

}  // namespace leasehold::engine::optim
