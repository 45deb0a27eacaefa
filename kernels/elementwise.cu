#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <type_traits>

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
__global__ void bias_activation_kernel(T* y, const T* bias, int64_t rows, int64_t columns,
                                       bool relu) {
  const int64_t n = rows * columns;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    T v = y[i] + (bias ? bias[i % columns] : T(0));
    if (relu) v = v > T(0) ? v : T(0);  // as UnaryOp::Relu
    y[i] = v;
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
__global__ void uniform_kernel(T* out, int64_t n, double low, double span, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = static_cast<T>(uniform_between(seed, i, low, span));
  }
}

// The contiguous fast path: 16-byte words (Word<T>), kUnroll of them per thread with
// their loads issued before any store, so each thread keeps 64 bytes per
// operand in flight (the strided kernels above move 4 bytes per load).
constexpr int kUnroll = 4;

// The product rounded on its own, never fused into a following addition:
// dropout plus a residual gives the bits of the two operations.
__device__ inline float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ inline double mul_rn(double a, double b) { return __dmul_rn(a, b); }

// Dropout (plus `residual` when not null) a 16-byte word at a time, kUnroll
// words a thread with every load issued before a store (`words` of them;
// the elements past the words one at a time), the mask drawn as it goes.
template <class T>
__global__ void dropout_kernel(T* out, const T* x, const T* residual, int64_t n, int64_t words,
                               uint64_t threshold, T scale, RandomKey key) {
  constexpr int kLanes = Word<T>::kLanes;
  const uint64_t seed = key.resolve();
  const int64_t step = int64_t(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x; base < words;
       base += step) {
    Word<T> v[kUnroll], r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t w = base + int64_t(u) * blockDim.x;
      if (w < words) {
        v[u] = reinterpret_cast<const Word<T>*>(x)[w];
        if (residual) r[u] = reinterpret_cast<const Word<T>*>(residual)[w];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t w = base + int64_t(u) * blockDim.x;
      if (w >= words) break;
#pragma unroll
      for (int j = 0; j < kLanes; ++j) {
        const T kept =
            dropout_keeps(seed, w * kLanes + j, threshold) ? mul_rn(v[u].v[j], scale) : T(0);
        v[u].v[j] = residual ? r[u].v[j] + kept : kept;
      }
      reinterpret_cast<Word<T>*>(out)[w] = v[u];
    }
  }
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = words * kLanes + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const T kept = dropout_keeps(seed, i, threshold) ? mul_rn(x[i], scale) : T(0);
    out[i] = residual ? residual[i] + kept : kept;
  }
}

template <class T>
__global__ void unary_words_kernel(UnaryOp op, T s, Word<T>* out, const Word<T>* in,
                                   int64_t words) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x; base < words;
       base += step) {
    Word<T> x[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < words) x[u] = in[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i >= words) break;
      Word<T> y;
#pragma unroll
      for (int j = 0; j < Word<T>::kLanes; ++j) y.v[j] = apply_unary<T>(op, x[u].v[j], s);
      out[i] = y;
    }
  }
}

template <class T>
__global__ void binary_words_kernel(BinaryOp op, T s, Word<T>* out, const Word<T>* a,
                                    const Word<T>* b, int64_t words) {
  const int64_t step = int64_t(gridDim.x) * blockDim.x * kUnroll;
  for (int64_t base = int64_t(blockIdx.x) * blockDim.x * kUnroll + threadIdx.x; base < words;
       base += step) {
    Word<T> x[kUnroll], y[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < words) {
        x[u] = a[i];
        y[u] = b[i];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i >= words) break;
      Word<T> z;
#pragma unroll
      for (int j = 0; j < Word<T>::kLanes; ++j) z.v[j] = apply_binary<T>(op, x[u].v[j], y[u].v[j], s);
      out[i] = z;
    }
  }
}

unsigned words_grid(int64_t words) {
  const int64_t per_block = int64_t(kBlock) * kUnroll;
  return static_cast<unsigned>(std::clamp<int64_t>((words + per_block - 1) / per_block, 1, 65535));
}

// The last n % lanes elements of a contiguous operation, past the words.
Strided contiguous_tail(int64_t n) {
  Strided t;
  t.ndim = 1;
  t.sizes[0] = n;
  t.strides[0] = 1;
  t.contiguous = true;
  return t;
}

template <class To, class From>
__global__ void convert_kernel(To* out, const From* in, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    out[i] = static_cast<To>(in[i]);
  }
}

// float32 <-> bfloat16 eight elements a thread: one 16-byte access on the
// bfloat16 side, two on the float32 side (the GEMM inputs autocast makes
// are a step's largest conversions).
struct alignas(16) Bf16x8 {
  bfloat16 v[8];
};
struct alignas(16) F32x8 {
  float4 lo, hi;
};

// Bf16Copies's tensors in groups of eight elements (cumulative counts),
// and which tensors' input and output both start 16-byte aligned (bit k).
struct ConvertGroups {
  int64_t end[kMaxConvertTensors];
  uint32_t aligned = 0;
};
static_assert(kMaxConvertTensors <= 32, "ConvertGroups::aligned has a bit per tensor");

__device__ inline Bf16x8 to_bf16x8(const F32x8& x) {
  const float f[8] = {x.lo.x, x.lo.y, x.lo.z, x.lo.w, x.hi.x, x.hi.y, x.hi.z, x.hi.w};
  Bf16x8 y;
#pragma unroll
  for (int j = 0; j < 8; ++j) y.v[j] = bfloat16(f[j]);
  return y;
}

__device__ inline F32x8 to_f32x8(const Bf16x8& x) {
  F32x8 y;
  y.lo = make_float4(float(x.v[0]), float(x.v[1]), float(x.v[2]), float(x.v[3]));
  y.hi = make_float4(float(x.v[4]), float(x.v[5]), float(x.v[6]), float(x.v[7]));
  return y;
}

// Bf16Copies: a thread converts eight elements of one tensor (one group;
// each tensor's groups end with its last element, so a group never spans
// two), as one 16-byte store where its tensor's input and output are
// 16-byte aligned and the group is whole, else element by element.
__global__ void convert_bf16_copies_kernel(Bf16Copies t, ConvertGroups groups) {
  const int64_t total = groups.end[t.count - 1];
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    int k = 0;
    while (i >= groups.end[k]) ++k;  // at most kMaxConvertTensors steps
    const int64_t first = (i - (k ? groups.end[k - 1] : 0)) * 8;
    const int64_t n = t.end[k] - (k ? t.end[k - 1] : 0);
    const float* in = t.in[k];
    bfloat16* out = t.out[k];
    if (first + 8 <= n && (groups.aligned >> k & 1u)) {
      reinterpret_cast<Bf16x8*>(out + first)[0] =
          to_bf16x8(reinterpret_cast<const F32x8*>(in + first)[0]);
    } else {
      for (int64_t j = first; j < n && j < first + 8; ++j) out[j] = bfloat16(in[j]);
    }
  }
}

// Eight elements a thread where all three are 16-byte aligned (`groups` of
// eight), then one a thread for the rest.
__global__ void gelu_backward_bf16_kernel(bfloat16* dx, const bfloat16* g, const bfloat16* x,
                                          int64_t n, bool vectors) {
  const int64_t groups = vectors ? n / 8 : 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < groups;
       i += int64_t(gridDim.x) * blockDim.x) {
    const Bf16x8 gv = reinterpret_cast<const Bf16x8*>(g)[i];
    const Bf16x8 xv = reinterpret_cast<const Bf16x8*>(x)[i];
    Bf16x8 y;
#pragma unroll
    for (int j = 0; j < 8; ++j) y.v[j] = gelu_grad_bf16(gv.v[j], xv.v[j]);
    reinterpret_cast<Bf16x8*>(dx)[i] = y;
  }
  for (int64_t i = groups * 8 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x) {
    dx[i] = gelu_grad_bf16(g[i], x[i]);
  }
}

// Eight elements of float32 or bfloat16 as float32, and back (rounded).
__device__ inline F32x8 load_x8(const float* p, int64_t i) {
  return reinterpret_cast<const F32x8*>(p)[i];
}
__device__ inline F32x8 load_x8(const bfloat16* p, int64_t i) {
  return to_f32x8(reinterpret_cast<const Bf16x8*>(p)[i]);
}
__device__ inline void store_x8(float* p, int64_t i, const F32x8& v) {
  reinterpret_cast<F32x8*>(p)[i] = v;
}
__device__ inline void store_x8(bfloat16* p, int64_t i, const F32x8& v) {
  reinterpret_cast<Bf16x8*>(p)[i] = to_bf16x8(v);
}

// Dropout between the float32 residual stream and a bfloat16 branch: In and
// Out are float and bfloat16 one way or the other; the product in float32,
// rounded on its own (mul_rn), then the residual added (when not null, of
// type Out = float) or the result rounded to Out. Eight elements a thread
// where every operand is 16-byte aligned (`groups` of eight), then one a
// thread.
template <class In, class Out>
__global__ void dropout_mixed_kernel(Out* out, const In* x, const float* residual, int64_t n,
                                     bool vectors, uint64_t threshold, float scale,
                                     RandomKey key) {
  const uint64_t seed = key.resolve();
  const int64_t groups = vectors ? n / 8 : 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < groups; i += stride) {
    const F32x8 v = load_x8(x, i);
    F32x8 r = {};
    if (residual) r = load_x8(residual, i);
    float e[8] = {v.lo.x, v.lo.y, v.lo.z, v.lo.w, v.hi.x, v.hi.y, v.hi.z, v.hi.w};
    const float f[8] = {r.lo.x, r.lo.y, r.lo.z, r.lo.w, r.hi.x, r.hi.y, r.hi.z, r.hi.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float kept = dropout_keeps(seed, i * 8 + j, threshold) ? mul_rn(e[j], scale) : 0.f;
      e[j] = residual ? f[j] + kept : kept;
    }
    store_x8(out, i, {make_float4(e[0], e[1], e[2], e[3]), make_float4(e[4], e[5], e[6], e[7])});
  }
  for (int64_t i = groups * 8 + blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const float kept = dropout_keeps(seed, i, threshold) ? mul_rn(float(x[i]), scale) : 0.f;
    out[i] = Out(residual ? residual[i] + kept : kept);
  }
}

template <class To, class From>
__global__ void convert_x8_kernel(To* out, const From* in, int64_t groups) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < groups;
       i += int64_t(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<To, bfloat16>) {
      reinterpret_cast<Bf16x8*>(out)[i] = to_bf16x8(reinterpret_cast<const F32x8*>(in)[i]);
    } else {
      reinterpret_cast<F32x8*>(out)[i] = to_f32x8(reinterpret_cast<const Bf16x8*>(in)[i]);
    }
  }
}

}  // namespace

template <class T>
void unary(Stream queue, UnaryOp op, T s, T* out, const T* in, const Strided& iv, int64_t n) {
  cudaStream_t stream = as_cuda(queue);
  if (n == 0) return;
  constexpr int kLanes = Word<T>::kLanes;
  if (iv.contiguous && iv.offset == 0 && aligned16(out) && aligned16(in)) {
    const int64_t words = n / kLanes, tail = n - words * kLanes;
    if (words > 0) {
      unary_words_kernel<T><<<words_grid(words), kBlock, 0, stream>>>(
          op, s, reinterpret_cast<Word<T>*>(out), reinterpret_cast<const Word<T>*>(in), words);
      LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    }
    if (tail == 0) return;
    const int64_t done = words * kLanes;
    unary_kernel<T><<<grid_for(tail), kBlock, 0, stream>>>(op, s, out + done, in + done,
                                                          contiguous_tail(tail), tail);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    return;
  }
  unary_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(op, s, out, in, iv, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void binary(Stream queue, BinaryOp op, T s, T* out, const T* a, const Strided& av, const T* b,
            const Strided& bv, int64_t n) {
  cudaStream_t stream = as_cuda(queue);
  if (n == 0) return;
  constexpr int kLanes = Word<T>::kLanes;
  if (av.contiguous && bv.contiguous && av.offset == 0 && bv.offset == 0 && aligned16(out) &&
      aligned16(a) && aligned16(b)) {
    const int64_t words = n / kLanes, tail = n - words * kLanes;
    if (words > 0) {
      binary_words_kernel<T><<<words_grid(words), kBlock, 0, stream>>>(
          op, s, reinterpret_cast<Word<T>*>(out), reinterpret_cast<const Word<T>*>(a),
          reinterpret_cast<const Word<T>*>(b), words);
      LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    }
    if (tail == 0) return;
    const int64_t done = words * kLanes;
    const Strided t = contiguous_tail(tail);
    binary_kernel<T><<<grid_for(tail), kBlock, 0, stream>>>(op, s, out + done, a + done, t,
                                                           b + done, t, tail);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    return;
  }
  binary_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(op, s, out, a, av, b, bv, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void bias_activation(Stream queue, T* y, const T* bias, int64_t rows, int64_t columns, bool relu) {
  cudaStream_t stream = as_cuda(queue);
  if (rows * columns == 0) return;
  bias_activation_kernel<T><<<grid_for(rows * columns), kBlock, 0, stream>>>(y, bias, rows,
                                                                             columns, relu);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void fill(Stream queue, T* out, T value, int64_t n) {
  cudaStream_t stream = as_cuda(queue);
  if (n == 0) return;
  fill_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(out, value, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void strided_copy(Stream queue, T* dst, const Strided& dv, const T* src, const Strided& sv,
                  int64_t n) {
  cudaStream_t stream = as_cuda(queue);
  if (n == 0) return;
  strided_copy_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(dst, dv, src, sv, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

namespace {

template <class In, class Out>
void launch_dropout_mixed(Stream queue, Out* out, const In* x, int64_t n, double p,
                          RandomKey key, const float* residual) {
  if (n == 0) return;
  const bool vectors = aligned16(out) && aligned16(x) && (!residual || aligned16(residual));
  dropout_mixed_kernel<In, Out><<<grid_for(vectors ? n / 8 + n % 8 : n), kBlock, 0,
                                  as_cuda(queue)>>>(out, x, residual, n, vectors,
                                                    dropout_threshold(p),
                                                    float(1.0 / (1.0 - p)), key);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void dropout_bf16_branch(Stream s, float* out, const bfloat16* x, int64_t n, double p,
                         RandomKey key, const float* residual) {
  launch_dropout_mixed(s, out, x, n, p, key, residual);
}

void dropout_bf16_gradient(Stream s, bfloat16* out, const float* g, int64_t n, double p,
                           RandomKey key) {
  launch_dropout_mixed<float, bfloat16>(s, out, g, n, p, key, nullptr);
}

template <class T>
void dropout(Stream queue, T* out, const T* x, int64_t n, double p, RandomKey key,
             const T* residual) {
  cudaStream_t stream = as_cuda(queue);
  if (n == 0) return;
  const bool aligned = aligned16(out) && aligned16(x) && (!residual || aligned16(residual));
  const int64_t words = aligned ? n / Word<T>::kLanes : 0;
  dropout_kernel<T><<<words > 0 ? words_grid(words) : grid_for(n), kBlock, 0, stream>>>(
      out, x, residual, n, words, dropout_threshold(p), T(1.0 / (1.0 - p)), key);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void uniform_fill(Stream queue, T* out, int64_t n, double low, double high, uint64_t seed) {
  cudaStream_t stream = as_cuda(queue);
  if (n == 0) return;
  uniform_kernel<T><<<grid_for(n), kBlock, 0, stream>>>(out, n, low, high - low, seed);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class To, class From>
void convert(Stream queue, To* out, const From* in, int64_t n) {
  cudaStream_t stream = as_cuda(queue);
  if (n == 0) return;
  constexpr bool kBf16Pair = (std::is_same_v<To, bfloat16> && std::is_same_v<From, float>) ||
                             (std::is_same_v<To, float> && std::is_same_v<From, bfloat16>);
  if constexpr (kBf16Pair) {
    if (aligned16(out) && aligned16(in)) {
      const int64_t groups = n / 8;
      if (groups > 0) {
        convert_x8_kernel<To, From><<<grid_for(groups), kBlock, 0, stream>>>(out, in, groups);
        LEASEHOLD_CUDA_CHECK(cudaGetLastError());
      }
      out += groups * 8;
      in += groups * 8;
      n -= groups * 8;
      if (n == 0) return;
    }
  }
  convert_kernel<To, From><<<grid_for(n), kBlock, 0, stream>>>(out, in, n);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

void convert_bf16_copies(Stream queue, const Bf16Copies& t) {
  if (t.count <= 0) return;
  if (t.count > kMaxConvertTensors) {
    throw std::invalid_argument("convert_bf16_copies: more than kMaxConvertTensors tensors");
  }
  ConvertGroups groups;
  int64_t total = 0;
  for (int k = 0; k < t.count; ++k) {
    total += (t.end[k] - (k ? t.end[k - 1] : 0) + 7) / 8;
    groups.end[k] = total;
    if (aligned16(t.in[k]) && aligned16(t.out[k])) groups.aligned |= 1u << k;
  }
  if (total == 0) return;
  convert_bf16_copies_kernel<<<grid_for(total), kBlock, 0, as_cuda(queue)>>>(t, groups);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

void gelu_backward_bf16(Stream queue, bfloat16* dx, const bfloat16* g, const bfloat16* x,
                        int64_t n) {
  if (n == 0) return;
  const bool vectors = aligned16(dx) && aligned16(g) && aligned16(x);
  gelu_backward_bf16_kernel<<<grid_for(vectors ? (n + 7) / 8 : n), kBlock, 0, as_cuda(queue)>>>(
      dx, g, x, n, vectors);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

LEASEHOLD_ELEMENTWISE_INSTANCES
template void bias_activation<float>(Stream, float*, const float*, int64_t, int64_t, bool);
template void bias_activation<double>(Stream, double*, const double*, int64_t, int64_t, bool);

}  // namespace leasehold::kernels::cuda
