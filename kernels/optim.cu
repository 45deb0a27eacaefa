#include "kernels/launch.cuh"
#include "kernels/optim.h"

namespace leasehold::kernels::cuda {
namespace {

template <class T>
__global__ void sgd_kernel(T* p, const T* g, T* buf, int64_t n, SgdParams s) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    detail::sgd_at(p, g, buf, s, i);
  }
}

template <class T>
__global__ void adam_kernel(T* p, const T* g, T* m, T* v, int64_t n, AdamParams a, double bc1,
                            double bc2) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    detail::adam_at(p, g, m, v, a, bc1, bc2, i);
  }
}

}  // namespace

template <class T>
void sgd_step(T* param, const T* grad, T* buf, int64_t n, const SgdParams& s,
              cudaStream_t stream) {
  if (n == 0) return;
  sgd_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(param, grad, buf, n, s);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void adam_step(T* param, const T* grad, T* m, T* v, int64_t n, const AdamParams& a,
               cudaStream_t stream) {
  if (n == 0) return;
  double bc1 = 1 - pow(a.beta1, double(a.step)), bc2 = 1 - pow(a.beta2, double(a.step));
  adam_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(param, grad, m, v, n, a, bc1, bc2);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template void sgd_step<float>(float*, const float*, float*, int64_t, const SgdParams&,
                              cudaStream_t);
template void sgd_step<double>(double*, const double*, double*, int64_t, const SgdParams&,
                               cudaStream_t);
template void adam_step<float>(float*, const float*, float*, float*, int64_t, const AdamParams&,
                               cudaStream_t);
template void adam_step<double>(double*, const double*, double*, double*, int64_t,
                                const AdamParams&, cudaStream_t);

}  // namespace leasehold::kernels::cuda
