#include <math.h>

#include "kernels/optim.h"

namespace leasehold::kernels::cpu {

template <class T>
void sgd_step(T* param, const T* grad, T* buf, int64_t n, const SgdParams& s) {
  for (int64_t i = 0; i < n; ++i) detail::sgd_at(param, grad, buf, s, i);
}

template <class T>
void adam_step(T* param, const T* grad, T* m, T* v, int64_t n, const AdamParams& a) {
  double bc1 = 1 - pow(a.beta1, double(a.step)), bc2 = 1 - pow(a.beta2, double(a.step));
  for (int64_t i = 0; i < n; ++i) detail::adam_at(param, grad, m, v, a, bc1, bc2, i);
}

template void sgd_step<float>(float*, const float*, float*, int64_t, const SgdParams&);
template void sgd_step<double>(double*, const double*, double*, int64_t, const SgdParams&);
template void adam_step<float>(float*, const float*, float*, float*, int64_t, const AdamParams&);
template void adam_step<double>(double*, const double*, double*, double*, int64_t,
                                const AdamParams&);

}  // namespace leasehold::kernels::cpu
