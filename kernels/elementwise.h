// Elementwise kernels. `out` is contiguous with `n` elements; inputs are
// read through Strided views (broadcasting is stride 0). CPU versions run on
// the calling thread; CUDA versions enqueue on `stream` and check the launch.
#pragma once

#include <cstdint>

#include "kernels/bfloat16.h"
#include "kernels/elementwise_ops.h"
#include "kernels/strided.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace leasehold::kernels {

namespace cpu {
template <class T>
void unary(UnaryOp op, T scalar, T* out, const T* in, const Strided& iv, int64_t n);
template <class T>
void binary(BinaryOp op, T scalar, T* out, const T* a, const Strided& av, const T* b,
            const Strided& bv, int64_t n);
template <class T>
void fill(T* out, T value, int64_t n);
// dst[dv.at(i)] = src[sv.at(i)] for i < n: writes into a view.
template <class T>
void strided_copy(T* dst, const Strided& dv, const T* src, const Strided& sv, int64_t n);
// out[i] = (uniform(seed, i) >= p) / (1 - p): the dropout scale mask.
template <class T>
void dropout_mask(T* out, int64_t n, double p, uint64_t seed);
// out[i] = low + (high - low) * uniform(seed, i), in double, then rounded to
// T: parameter initialisation, the same values on CPU and GPU.
template <class T>
void uniform_fill(T* out, int64_t n, double low, double high, uint64_t seed);
// Converts between element types (float <-> double <-> int64).
template <class To, class From>
void convert(To* out, const From* in, int64_t n);
}  // namespace cpu

#ifdef LEASEHOLD_HAVE_CUDA
namespace cuda {
template <class T>
void unary(UnaryOp op, T scalar, T* out, const T* in, const Strided& iv, int64_t n,
           cudaStream_t stream);
template <class T>
void binary(BinaryOp op, T scalar, T* out, const T* a, const Strided& av, const T* b,
            const Strided& bv, int64_t n, cudaStream_t stream);
template <class T>
void fill(T* out, T value, int64_t n, cudaStream_t stream);
template <class T>
void strided_copy(T* dst, const Strided& dv, const T* src, const Strided& sv, int64_t n,
                  cudaStream_t stream);
template <class T>
void dropout_mask(T* out, int64_t n, double p, uint64_t seed, cudaStream_t stream);
template <class T>
void uniform_fill(T* out, int64_t n, double low, double high, uint64_t seed, cudaStream_t stream);
template <class To, class From>
void convert(To* out, const From* in, int64_t n, cudaStream_t stream);
// y[r, c] = y[r, c] + bias[c] for contiguous [rows, columns], then max(., 0)
// when `relu`: a fully connected layer's epilogue after its GEMM, in one
// pass. `bias` may be null.
template <class T>
void bias_activation(T* y, const T* bias, int64_t rows, int64_t columns, bool relu,
                     cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace leasehold::kernels
