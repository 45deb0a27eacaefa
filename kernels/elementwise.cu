#include "kernels/elementwise.h"
#include "kernels/launch.cuh"

namespace leasehold::kernels::cuda {
namespace {

template <class T>
__global__ void unary_kernel(UnaryOp op, T s, T* out, const T* in, Strided iv, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = apply_unary<T>(op, in[iv.at(i)], s);
  }
}

template <class T>
__global__ void binary_kernel(BinaryOp op, T s, T* out, const T* a, Strided av, const T* b,
                              Strided bv, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = apply_binary<T>(op, a[av.at(i)], b[bv.at(i)], s);
  }
}

template <class T>
__global__ void fill_kernel(T* out, T value, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = value;
  }
}

template <class T>
__global__ void strided_copy_kernel(T* dst, Strided dv, const T* src, Strided sv, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dst[dv.at(i)] = src[sv.at(i)];
  }
}

template <class T>
__global__ void dropout_kernel(T* out, int64_t n, double p, uint64_t seed) {
  const T keep = T(1.0 / (1.0 - p));
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = uniform01(seed, i) >= p ? keep : T(0);
  }
}

template <class T>
__global__ void uniform_kernel(T* out, int64_t n, double low, double span, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = static_cast<T>(uniform_between(seed, i, low, span));
  }
}

template <class To, class From>
__global__ void convert_kernel(To* out, const From* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = static_cast<To>(in[i]);
  }
}

}  // namespace

template <class T>
void unary(UnaryOp op, T s, T* out, const T* in, const Strided& iv, int64_t n,
           cudaStream_t stream) {
  if (n == 0) return;
  unary_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(op, s, out, in, iv, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void binary(BinaryOp op, T s, T* out, const T* a, const Strided& av, const T* b,
            const Strided& bv, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  binary_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(op, s, out, a, av, b, bv, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void fill(T* out, T value, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(out, value, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void strided_copy(T* dst, const Strided& dv, const T* src, const Strided& sv, int64_t n,
                  cudaStream_t stream) {
  if (n == 0) return;
  strided_copy_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(dst, dv, src, sv, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void dropout_mask(T* out, int64_t n, double p, uint64_t seed, cudaStream_t stream) {
  if (n == 0) return;
  dropout_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(out, n, p, seed);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void uniform_fill(T* out, int64_t n, double low, double high, uint64_t seed, cudaStream_t stream) {
  if (n == 0) return;
  uniform_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(out, n, low, high - low, seed);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class To, class From>
void convert(To* out, const From* in, int64_t n, cudaStream_t stream) {
  if (n == 0) return;
  convert_kernel<To, From><<<grid_for(n), kBlock, 0, stream>>>(out, in, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

#define LEASEHOLD_INSTANTIATE(T)                                                              \
  template void unary<T>(UnaryOp, T, T*, const T*, const Strided&, int64_t, cudaStream_t);    \
  template void binary<T>(BinaryOp, T, T*, const T*, const Strided&, const T*,                \
                          const Strided&, int64_t, cudaStream_t);                             \
  template void fill<T>(T*, T, int64_t, cudaStream_t);                                       \
  template void strided_copy<T>(T*, const Strided&, const T*, const Strided&, int64_t,        \
                                cudaStream_t);
LEASEHOLD_INSTANTIATE(float)
LEASEHOLD_INSTANTIATE(double)
LEASEHOLD_INSTANTIATE(int64_t)
#undef LEASEHOLD_INSTANTIATE
template void dropout_mask<float>(float*, int64_t, double, uint64_t, cudaStream_t);
template void dropout_mask<double>(double*, int64_t, double, uint64_t, cudaStream_t);
template void uniform_fill<float>(float*, int64_t, double, double, uint64_t, cudaStream_t);
template void uniform_fill<double>(double*, int64_t, double, double, uint64_t, cudaStream_t);
#define LEASEHOLD_CONVERT(To, From) \
  template void convert<To, From>(To*, const From*, int64_t, cudaStream_t);
LEASEHOLD_CONVERT(float, double)
LEASEHOLD_CONVERT(double, float)
LEASEHOLD_CONVERT(float, int64_t)
LEASEHOLD_CONVERT(double, int64_t)
LEASEHOLD_CONVERT(int64_t, float)
LEASEHOLD_CONVERT(int64_t, double)
#undef LEASEHOLD_CONVERT

}  // namespace leasehold::kernels::cuda
