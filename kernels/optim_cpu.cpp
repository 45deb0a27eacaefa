#include <math.h>

#include "kernels/optim.h"

namespace leasehold::kernels::cpu {

void advance_step(Stream, int64_t* step) { ++*step; }

template <class T>
void sgd_step(Stream, T* param, const T* grad, T* buf, int64_t n, const SgdParams& s) {
  const double lr = s.lr.at(*s.step - 1);
  for (int64_t i = 0; i < n; ++i) detail::sgd_at(param, grad, buf, s, lr, i);
}

template <class T>
void adam_step_fused(Stream, const AdamTensors<T>& t, const AdamParams& a) {
  const detail::AdamCoefficients<T> c(a);
  for (int k = 0; k < t.count; ++k) {
    const int64_t n = t.end[k] - (k ? t.end[k - 1] : 0);
    for (int64_t i = 0; i < n; ++i) detail::adam_at(t.p[k], t.g[k], t.m[k], t.v[k], c, i);
  }
}

template <class T>
void sum_squares_fused(Stream, const GradTensors<T>& t, T* partial) {
  for (int k = 0; k < t.count; ++k) {
    const int64_t n = t.end[k] - (k ? t.end[k - 1] : 0);
    for (int part = 0; part < kNormParts; ++part) {
      T s = 0;
      for (int64_t i = norm_part_begin(n, part); i < norm_part_begin(n, part + 1); ++i) {
        s += t.g[k][i] * t.g[k][i];
      }
      partial[k * kNormParts + part] = s;
    }
  }
}

template <class T>
void scale_fused(Stream, const GradTensors<T>& t, const T* coef) {
  for (int k = 0; k < t.count; ++k) {
    const int64_t n = t.end[k] - (k ? t.end[k - 1] : 0);
    for (int64_t i = 0; i < n; ++i) t.g[k][i] *= *coef;
  }
}

LEASEHOLD_OPTIM_INSTANCES_OF(float)
LEASEHOLD_OPTIM_INSTANCES_OF(double)

}  // namespace leasehold::kernels::cpu
