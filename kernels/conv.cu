#include "kernels/conv.h"
#include "kernels/launch.cuh"

namespace leasehold::kernels::cuda {
namespace {

template <class T>
__global__ void im2col_kernel(T* col, const T* x, ConvGeometry g, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    col[i] = detail::im2col_at(x, g, i);
  }
}

template <class T>
__global__ void col2im_kernel(T* dx, const T* dcol, ConvGeometry g, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    dx[i] = detail::col2im_at(dcol, g, i);
  }
}

template <class T>
__global__ void max_pool_kernel(T* out, int64_t* argmax, const T* x, PoolGeometry g,
                                int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    detail::max_pool_at(out, argmax, x, g, i);
  }
}

// Overlapping windows (stride < k) can route two gradients to one input.
template <class T>
__global__ void max_pool_backward_kernel(T* dx, const T* dout, const int64_t* argmax,
                                         PoolGeometry g, int64_t total) {
  int64_t per_plane = g.oh() * g.ow();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    atomicAdd(dx + (i / per_plane) * g.h * g.w + argmax[i], dout[i]);
  }
}

}  // namespace

template <class T>
void im2col(T* col, const T* x, const ConvGeometry& g, cudaStream_t stream) {
  int64_t total = g.n * g.c * g.kh * g.kw * g.oh() * g.ow();
  if (total == 0) return;
  im2col_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(col, x, g, total);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void col2im(T* dx, const T* dcol, const ConvGeometry& g, cudaStream_t stream) {
  int64_t total = g.n * g.c * g.h * g.w;
  if (total == 0) return;
  col2im_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(dx, dcol, g, total);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void max_pool(T* out, int64_t* argmax, const T* x, const PoolGeometry& g, cudaStream_t stream) {
  int64_t total = g.n * g.c * g.oh() * g.ow();
  if (total == 0) return;
  max_pool_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(out, argmax, x, g, total);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void max_pool_backward(T* dx, const T* dout, const int64_t* argmax, const PoolGeometry& g,
                       cudaStream_t stream) {
  int64_t total = g.n * g.c * g.oh() * g.ow();
  if (total == 0) return;
  max_pool_backward_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(dx, dout, argmax, g, total);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

#define LEASEHOLD_INSTANTIATE(T)                                                          \
  template void im2col<T>(T*, const T*, const ConvGeometry&, cudaStream_t);               \
  template void col2im<T>(T*, const T*, const ConvGeometry&, cudaStream_t);               \
  template void max_pool<T>(T*, int64_t*, const T*, const PoolGeometry&, cudaStream_t);   \
  template void max_pool_backward<T>(T*, const T*, const int64_t*, const PoolGeometry&,   \
                                     cudaStream_t);
LEASEHOLD_INSTANTIATE(float)
LEASEHOLD_INSTANTIATE(double)
#undef LEASEHOLD_INSTANTIATE

}  // namespace leasehold::kernels::cuda
