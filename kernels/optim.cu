#include "kernels/block_reduce.cuh"
#include "kernels/launch.cuh"
#include "kernels/optim.h"

namespace leasehold::kernels::cuda {
namespace {

__global__ void advance_kernel(int64_t* step) { ++*step; }

template <class T>
__global__ void sgd_kernel(T* p, const T* g, T* buf, int64_t n, SgdParams s) {
  const double lr = s.lr.at(*s.step - 1);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    detail::sgd_at(p, g, buf, s, lr, i);
  }
}

// Every thread works out the step's coefficients (the step counter is read
// on the device, for a graph's replays), in double: a few hundred
// instructions, so the grid is capped at kAdamBlocks and each thread
// updates many elements.
constexpr int64_t kAdamBlocks = 1024;

template <class T>
__global__ void adam_fused_kernel(AdamTensors<T> t, AdamParams a) {
  const detail::AdamCoefficients<T> c(a);
  const int64_t total = t.end[t.count - 1];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int k = 0;
    while (i >= t.end[k]) ++k;  // at most kMaxFusedTensors steps
    detail::adam_at(t.p[k], t.g[k], t.m[k], t.v[k], c, i - (k ? t.end[k - 1] : 0));
  }
}

// A block per part of each gradient: blockIdx.x the part, blockIdx.y the
// gradient.
template <class T>
__global__ void sum_squares_kernel(GradTensors<T> t, T* partial) {
  const int k = blockIdx.y, part = blockIdx.x;
  const int64_t n = t.end[k] - (k ? t.end[k - 1] : 0);
  const T* g = t.g[k];
  T s = 0;
  for (int64_t i = norm_part_begin(n, part) + threadIdx.x; i < norm_part_begin(n, part + 1);
       i += blockDim.x) {
    s += g[i] * g[i];
  }
  s = block_sum(s);
  if (threadIdx.x == 0) partial[k * kNormParts + part] = s;
}

template <class T>
__global__ void scale_fused_kernel(GradTensors<T> t, const T* coef) {
  const T c = *coef;
  const int64_t total = t.end[t.count - 1];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int k = 0;
    while (i >= t.end[k]) ++k;  // at most kMaxFusedTensors steps
    t.g[k][i - (k ? t.end[k - 1] : 0)] *= c;
  }
}

}  // namespace

void advance_step(Stream queue, int64_t* step) {
  advance_kernel<<<1, 1, 0, as_cuda(queue)>>>(step);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void sgd_step(Stream queue, T* param, const T* grad, T* buf, int64_t n, const SgdParams& s) {
  cudaStream_t stream = as_cuda(queue);
  if (n == 0) return;
  sgd_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(param, grad, buf, n, s);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void adam_step_fused(Stream queue, const AdamTensors<T>& t, const AdamParams& a) {
  cudaStream_t stream = as_cuda(queue);
  if (t.count == 0 || t.end[t.count - 1] == 0) return;
  const unsigned grid = std::min<unsigned>(grid_for(t.end[t.count - 1]), kAdamBlocks);
  adam_fused_kernel<T><<<grid, kBlock, 0, stream>>>(t, a);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void sum_squares_fused(Stream queue, const GradTensors<T>& t, T* partial) {
  if (t.count == 0) return;
  sum_squares_kernel<T><<<dim3(kNormParts, t.count), 512, 0, as_cuda(queue)>>>(t, partial);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void scale_fused(Stream queue, const GradTensors<T>& t, const T* coef) {
  if (t.count == 0 || t.end[t.count - 1] == 0) return;
  scale_fused_kernel<T><<<grid_for(t.end[t.count - 1]), kBlock, 0, as_cuda(queue)>>>(t, coef);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

LEASEHOLD_OPTIM_INSTANCES_OF(float)
LEASEHOLD_OPTIM_INSTANCES_OF(double)

}  // namespace leasehold::kernels::cuda
