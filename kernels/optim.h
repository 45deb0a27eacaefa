// Fused optimiser updates, one pass over a parameter and its state. They
// follow PyTorch's torch.optim.SGD and torch.optim.Adam (L2 weight decay added
// to the gradient, no dampening, no Nesterov, no amsgrad), and AdamW
// (torch.optim.AdamW: the parameter shrinks by lr × weight_decay first, the
// gradient stays as it is).
#pragma once

#include <math.h>  // cos and pow in host and device code
#include <cstdint>

#include "kernels/pattern.h"  // LEASEHOLD_HOST_DEVICE

#include "kernels/stream.h"

namespace leasehold::kernels {

// The learning rate of each step: linear warm-up from lr/warmup to lr over
// the first `warmup` steps, then a cosine from lr down to min_lr at step
// `total`, min_lr after (nanoGPT's schedule); `lr` throughout when it does
// not decay. Evaluated where the update runs, from the step counter there,
// so that a step captured as a CUDA graph follows the schedule as it is
// replayed.
struct LrSchedule {
  double lr = 1e-3, min_lr = 1e-4;
  int64_t warmup = 0, total = 1;
  bool decays = true;
  static LrSchedule constant(double lr) { return {lr, lr, 0, 0, false}; }
  // The rate of step `index` (0-based).
  LEASEHOLD_HOST_DEVICE double at(int64_t index) const {
    if (!decays) return lr;
    if (index < warmup) return lr * static_cast<double>(index + 1) / static_cast<double>(warmup);
    if (index >= total) return min_lr;
    const int64_t span = total - warmup > 1 ? total - warmup : 1;
    const double ratio = static_cast<double>(index - warmup) / static_cast<double>(span);
    return min_lr + 0.5 * (1 + cos(3.14159265358979323846 * ratio)) * (lr - min_lr);
  }
};

// Both updates read the number of the update they make (1-based: the
// optimizer's step counter, advanced by advance_step just before) from
// `step`, in the memory they run on.
struct SgdParams {
  LrSchedule lr = LrSchedule::constant(0.01);
  double momentum = 0, weight_decay = 0;
  bool first_step = true;  // the momentum buffer starts as the gradient
  const int64_t* step = nullptr;
};

struct AdamParams {
  LrSchedule lr = LrSchedule::constant(1e-3);
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  bool decoupled = false;  // AdamW's weight decay
  const int64_t* step = nullptr;
};

// Several parameters updated by one launch: a small model's step is short,
// and a launch per parameter costs more than its update (LeNet: ten Adam
// launches of about 4 us each on an H100). Passed to the kernel by value;
// the CPU walks the same list.
inline constexpr int kMaxFusedTensors = 16;
template <class T>
struct AdamTensors {
  T* p[kMaxFusedTensors];
  const T* g[kMaxFusedTensors];
  T* m[kMaxFusedTensors];
  T* v[kMaxFusedTensors];
  int64_t end[kMaxFusedTensors];  // cumulative element counts
  int count = 0;
};

// Gradients for gradient-norm clipping's two fused passes (sum_squares_fused
// and scale_fused), up to kMaxFusedTensors per launch as in AdamTensors:
// a launch per gradient, as several small ops each, made most of a GPT
// step's launches.
template <class T>
struct GradTensors {
  T* g[kMaxFusedTensors];
  int64_t end[kMaxFusedTensors];  // cumulative element counts
  int count = 0;
};
// The parts each gradient's sum of squares is split into (blocks on CUDA).
inline constexpr int kNormParts = 8;
// Part `part` of n elements: [begin, end).
LEASEHOLD_HOST_DEVICE inline int64_t norm_part_begin(int64_t n, int part) {
  return n / kNormParts * part + (part < n % kNormParts ? part : n % kNormParts);
}

namespace detail {
template <class T>
LEASEHOLD_HOST_DEVICE inline void sgd_at(T* p, const T* g, T* buf, const SgdParams& s, double lr,
                                         int64_t i) {
  T d = g[i] + T(s.weight_decay) * p[i];
  if (s.momentum != 0) {
    buf[i] = s.first_step ? d : T(s.momentum) * buf[i] + d;
    d = buf[i];
  }
  p[i] -= T(lr) * d;
}

// What every element of one Adam update shares: its learning rate and bias
// corrections, from the step counter.
struct AdamStepScalars {
  double lr, bc1, bc2;
  LEASEHOLD_HOST_DEVICE explicit AdamStepScalars(const AdamParams& a) {
    const int64_t step = *a.step;
    lr = a.lr.at(step - 1);
    bc1 = 1 - pow(a.beta1, static_cast<double>(step));
    bc2 = 1 - pow(a.beta2, static_cast<double>(step));
  }
};

// One update's coefficients in T, each rounded from double once (per
// update on the CPU, per thread on CUDA, where each thread updates many
// elements) rather than once per element: double arithmetic per element
// made the CUDA update four times slower than its memory traffic.
template <class T>
struct AdamCoefficients {
  T shrink, weight_decay, beta1, rest1, beta2, rest2, bc2, eps, step_size;
  bool decoupled;
  LEASEHOLD_HOST_DEVICE explicit AdamCoefficients(const AdamParams& a)
      : AdamCoefficients(a, AdamStepScalars(a)) {}
  LEASEHOLD_HOST_DEVICE AdamCoefficients(const AdamParams& a, const AdamStepScalars& s)
      : shrink(T(1 - s.lr * a.weight_decay)),
        weight_decay(T(a.weight_decay)),
        beta1(T(a.beta1)),
        rest1(T(1 - a.beta1)),
        beta2(T(a.beta2)),
        rest2(T(1 - a.beta2)),
        bc2(T(s.bc2)),
        eps(T(a.eps)),
        step_size(T(s.lr / s.bc1)),
        decoupled(a.decoupled) {}
};

// Element i's update: each operand read once and each result written once
// (p, m and v could alias as far as the compiler knows).
template <class T>
LEASEHOLD_HOST_DEVICE inline void adam_at(T* p, const T* g, T* m, T* v,
                                          const AdamCoefficients<T>& c, int64_t i) {
  T d = g[i], pi = p[i];
  if (c.decoupled) {
    pi *= c.shrink;
  } else {
    d += c.weight_decay * pi;
  }
  const T mi = c.beta1 * m[i] + c.rest1 * d;
  const T vi = c.beta2 * v[i] + c.rest2 * d * d;
  const T denom = sqrt(vi / c.bc2) + c.eps;
  m[i] = mi;
  v[i] = vi;
  p[i] = pi - c.step_size * mi / denom;
}
}  // namespace detail

#define LEASEHOLD_OPTIM_KERNELS(NS)                                                     \
  namespace NS {                                                                       \
  /* *step += 1: the optimizer's step counter, before an update. */                    \
  void advance_step(Stream s, int64_t* step);                                          \
  template <class T>                                                                   \
  void sgd_step(Stream s, T* param, const T* grad, T* momentum_buf, int64_t n,         \
                const SgdParams& p);                                                   \
  /* One Adam update of up to kMaxFusedTensors tensors (one launch on CUDA). */        \
  template <class T>                                                                   \
  void adam_step_fused(Stream s, const AdamTensors<T>& t, const AdamParams& a);        \
  /* partial[k * kNormParts + part] = the sum of the squares of part `part` of         \
     gradient k (norm_part_begin), each part summed in a fixed order. */               \
  template <class T>                                                                   \
  void sum_squares_fused(Stream s, const GradTensors<T>& t, T* partial);               \
  /* Every gradient's elements times *coef (one element, in the memory the update      \
     runs on, so no host read is needed). */                                           \
  template <class T>                                                                   \
  void scale_fused(Stream s, const GradTensors<T>& t, const T* coef);                  \
  }

// Explicit instantiations, expanded in optim_cpu.cpp and optim.cu.
#define LEASEHOLD_OPTIM_INSTANCES_OF(T)                                               \
  template void sgd_step<T>(Stream, T*, const T*, T*, int64_t, const SgdParams&); \
  template void adam_step_fused<T>(Stream, const AdamTensors<T>&, const AdamParams&); \
  template void sum_squares_fused<T>(Stream, const GradTensors<T>&, T*);              \
  template void scale_fused<T>(Stream, const GradTensors<T>&, const T*);

LEASEHOLD_OPTIM_KERNELS(cpu)
#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_OPTIM_KERNELS(cuda)
#endif
#undef LEASEHOLD_OPTIM_KERNELS

}  // namespace leasehold::kernels
