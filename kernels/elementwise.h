// Elementwise kernels. `out` is contiguous with `n` elements; inputs are
// read through Strided views (broadcasting is stride 0). CPU versions run on
// the calling thread; CUDA versions enqueue on the stream and check the
// launch.
#pragma once

#include <cstdint>

#include "kernels/bfloat16.h"
#include "kernels/elementwise_ops.h"
#include "kernels/stream.h"
#include "kernels/strided.h"


namespace leasehold::kernels {

// Float32 tensors converted to bfloat16 by one launch (up to
// kMaxConvertTensors; a caller with more launches again): autocast's copies
// of a model's weights and biases for a step, in one pass instead of a
// launch per tensor (two dozen conversions of a few hundred thousand
// elements each cost a GPT step more than twice what one pass over them
// does). Each copy has the bits convert<bfloat16, float> gives. Passed to
// the kernel by value.
inline constexpr int kMaxConvertTensors = 32;
struct Bf16Copies {
  const float* in[kMaxConvertTensors];
  bfloat16* out[kMaxConvertTensors];
  int64_t end[kMaxConvertTensors];  // cumulative element counts
  int count = 0;
};

#define LEASEHOLD_ELEMENTWISE_KERNELS(NS)                                                     \
  namespace NS {                                                                             \
  template <class T>                                                                         \
  void unary(Stream s, UnaryOp op, T scalar, T* out, const T* in, const Strided& iv,         \
             int64_t n);                                                                     \
  template <class T>                                                                         \
  void binary(Stream s, BinaryOp op, T scalar, T* out, const T* a, const Strided& av,        \
              const T* b, const Strided& bv, int64_t n);                                     \
  template <class T>                                                                         \
  void fill(Stream s, T* out, T value, int64_t n);                                           \
  /* dst[dv.at(i)] = src[sv.at(i)] for i < n: writes into a view. */                         \
  template <class T>                                                                         \
  void strided_copy(Stream s, T* dst, const Strided& dv, const T* src, const Strided& sv,    \
                    int64_t n);                                                              \
  /* Dropout of contiguous x: out[i] = x[i] / (1 - p) where element i is kept               \
     (dropout_keeps(key.resolve(), i, dropout_threshold(p))), else 0, plus residual[i]     \
     when residual is not null (rounded after the product, as the two operations round).   \
     The mask is drawn as it goes, so backward applies the same call to the gradient. out  \
     may be x or residual. */                                                               \
  template <class T>                                                                         \
  void dropout(Stream s, T* out, const T* x, int64_t n, double p, RandomKey key,             \
               const T* residual);                                                          \
  /* out[i] = low + (high - low) * uniform(seed, i), in double, then rounded to T:          \
     parameter initialisation, the same values on CPU and GPU. */                            \
  template <class T>                                                                         \
  void uniform_fill(Stream s, T* out, int64_t n, double low, double high, uint64_t seed);    \
  /* Converts between element types (float <-> double <-> int64, float <-> bfloat16). */    \
  template <class To, class From>                                                            \
  void convert(Stream s, To* out, const From* in, int64_t n);                                \
  /* Bf16Copies (above): t.out[k][i] = bfloat16(t.in[k][i]) for every tensor k. */           \
  void convert_bf16_copies(Stream s, const Bf16Copies& t);                                   \
  }

// Explicit instantiations, expanded in elementwise_cpu.cpp and elementwise.cu.
#define LEASEHOLD_ELEMENTWISE_INSTANCES_OF(T)                                                 \
  template void unary<T>(Stream, UnaryOp, T, T*, const T*, const Strided&, int64_t);         \
  template void binary<T>(Stream, BinaryOp, T, T*, const T*, const Strided&, const T*,       \
                          const Strided&, int64_t);                                          \
  template void fill<T>(Stream, T*, T, int64_t);                                             \
  template void strided_copy<T>(Stream, T*, const Strided&, const T*, const Strided&, int64_t);
#define LEASEHOLD_ELEMENTWISE_FLOATING_OF(T)                                                  \
  template void dropout<T>(Stream, T*, const T*, int64_t, double, RandomKey, const T*);      \
  template void uniform_fill<T>(Stream, T*, int64_t, double, double, uint64_t);
#define LEASEHOLD_CONVERT_OF(To, From) \
  template void convert<To, From>(Stream, To*, const From*, int64_t);
#define LEASEHOLD_ELEMENTWISE_INSTANCES                                                        \
  LEASEHOLD_ELEMENTWISE_INSTANCES_OF(float)                                                  \
  LEASEHOLD_ELEMENTWISE_INSTANCES_OF(double)                                                 \
  LEASEHOLD_ELEMENTWISE_INSTANCES_OF(int64_t)                                                \
  template void strided_copy<bfloat16>(Stream, bfloat16*, const Strided&, const bfloat16*,   \
                                       const Strided&, int64_t);                             \
  LEASEHOLD_ELEMENTWISE_FLOATING_OF(float)                                                   \
  LEASEHOLD_ELEMENTWISE_FLOATING_OF(double)                                                  \
  LEASEHOLD_CONVERT_OF(float, bfloat16)                                                      \
  LEASEHOLD_CONVERT_OF(bfloat16, float)                                                      \
  LEASEHOLD_CONVERT_OF(float, double)                                                        \
  LEASEHOLD_CONVERT_OF(double, float)                                                        \
  LEASEHOLD_CONVERT_OF(float, int64_t)                                                       \
  LEASEHOLD_CONVERT_OF(double, int64_t)                                                      \
  LEASEHOLD_CONVERT_OF(int64_t, float)                                                       \
  LEASEHOLD_CONVERT_OF(int64_t, double)

LEASEHOLD_ELEMENTWISE_KERNELS(cpu)

#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_ELEMENTWISE_KERNELS(cuda)
namespace cuda {
// y[r, c] = y[r, c] + bias[c] for contiguous [rows, columns], then max(., 0)
// when `relu`: a fully connected layer's epilogue after its GEMM, in one
// pass (CUDA only: the CPU's GEMM adds the bias itself). `bias` may be null.
template <class T>
void bias_activation(Stream s, T* y, const T* bias, int64_t rows, int64_t columns, bool relu);
// dx[i] = g[i] · gelu'(x[i]) (tanh form) in bfloat16, computed in float32:
// the backward of a product's fused GELU, from the GELU's input that the
// product kept, straight into the bfloat16 the next products read. dx
// may be g.
void gelu_backward_bf16(Stream s, bfloat16* dx, const bfloat16* g, const bfloat16* x, int64_t n);
// dropout (above) under autocast, for a bfloat16 branch x joining the
// float32 residual stream: out = residual + dropout(x) in float32, or
// without a residual (null) dropout(x); and its backward, the float32
// gradient g through the same mask (the same key) into the branch's
// bfloat16 gradient, rounded once. The mask and the products are
// dropout's: the bits of dropout of x's values in float32, then the
// addition, or the rounding.
void dropout_bf16_branch(Stream s, float* out, const bfloat16* x, int64_t n, double p,
                         RandomKey key, const float* residual);
void dropout_bf16_gradient(Stream s, bfloat16* out, const float* g, int64_t n, double p,
                           RandomKey key);
}  // namespace cuda
#endif
#undef LEASEHOLD_ELEMENTWISE_KERNELS

}  // namespace leasehold::kernels
