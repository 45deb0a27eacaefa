// Fused optimiser updates, one pass over a parameter and its state. They
// follow PyTorch's torch.optim.SGD and torch.optim.Adam (L2 weight decay added
// to the gradient, no dampening, no Nesterov, no amsgrad), and AdamW
// (torch.optim.AdamW: the parameter shrinks by lr × weight_decay first, the
// gradient stays as it is).
#pragma once

#include <cstdint>

#include "kernels/pattern.h"  // LEASEHOLD_HOST_DEVICE

#include "kernels/stream.h"

namespace leasehold::kernels {

struct SgdParams {
  double lr = 0.01, momentum = 0, weight_decay = 0;
  bool first_step = true;  // the momentum buffer starts as the gradient
};

struct AdamParams {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0;
  int64_t step = 1;  // 1 on the first update (bias correction)
  bool decoupled = false;  // AdamW's weight decay
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

namespace detail {
template <class T>
LEASEHOLD_HOST_DEVICE inline void sgd_at(T* p, const T* g, T* buf, const SgdParams& s, int64_t i) {
  T d = g[i] + T(s.weight_decay) * p[i];
  if (s.momentum != 0) {
    buf[i] = s.first_step ? d : T(s.momentum) * buf[i] + d;
    d = buf[i];
  }
  p[i] -= T(s.lr) * d;
}

template <class T>
LEASEHOLD_HOST_DEVICE inline void adam_at(T* p, const T* g, T* m, T* v, const AdamParams& a,
                                          double bc1, double bc2, int64_t i) {
  T d = g[i];
  if (a.decoupled) {
    p[i] *= T(1 - a.lr * a.weight_decay);
  } else {
    d += T(a.weight_decay) * p[i];
  }
  m[i] = T(a.beta1) * m[i] + T(1 - a.beta1) * d;
  v[i] = T(a.beta2) * v[i] + T(1 - a.beta2) * d * d;
  T denom = sqrt(v[i] / T(bc2)) + T(a.eps);
  p[i] -= T(a.lr / bc1) * m[i] / denom;
}
}  // namespace detail

#define LEASEHOLD_OPTIM_KERNELS(NS)                                                     \
  namespace NS {                                                                       \
  template <class T>                                                                   \
  void sgd_step(Stream s, T* param, const T* grad, T* momentum_buf, int64_t n,         \
                const SgdParams& p);                                                   \
  /* One Adam update of up to kMaxFusedTensors tensors (one launch on CUDA). */        \
  template <class T>                                                                   \
  void adam_step_fused(Stream s, const AdamTensors<T>& t, const AdamParams& a);        \
  }

// Explicit instantiations, expanded in optim_cpu.cpp and optim.cu.
#define LEASEHOLD_OPTIM_INSTANCES_OF(T)                                               \
  template void sgd_step<T>(Stream, T*, const T*, T*, int64_t, const SgdParams&); \
  template void adam_step_fused<T>(Stream, const AdamTensors<T>&, const AdamParams&);

LEASEHOLD_OPTIM_KERNELS(cpu)
#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_OPTIM_KERNELS(cuda)
#endif
#undef LEASEHOLD_OPTIM_KERNELS

}  // namespace leasehold::kernels
