// Kernels of the transformer layers: layer norm and fused causal attention
// (the embedding's are in embedding.h). Every kernel has one signature on both backends
// (the first argument is the stream, ignored on the CPU), so the engine
// lists each in one KernelTable (agent/engine/kernel_table.h) instead of
// branching on the device. Tensors are contiguous, but for attention's
// operands, whose rows an AttentionLayout places; T is float or double, and
// statistics (mean, 1/std, log-sum-exp) are kept in T.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/bfloat16.h"
#include "kernels/pattern.h"  // LEASEHOLD_HOST_DEVICE
#include "kernels/stream.h"

namespace leasehold::kernels {

// Layer norm's weight and bias gradients are summed over the rows in this
// many chunks of rows, then over the chunks: a count fixed by the shape, so
// the order of the sums never depends on the device. (On CUDA, which kernel
// runs, the register one or the scalar one, depends on the width and the
// operands' 16-byte alignment, and their roundings differ; the same
// operands give the same bits every run.) A chunk is a block of the
// backward kernel: one a 32 rows, at most 256 (longer chunks beyond). A
// GPT MLP in slices, 8192 rows, had 128 blocks of 64 rows, under one an SM
// of an H200, and its backward took 0.82 of the whole batch's time (0.62
// at 256 blocks); chunks of 16 rows made the whole batch's slower.
inline int64_t layer_norm_row_chunks(int64_t rows) {
  const int64_t chunks = (rows + 31) / 32;
  return chunks < 1 ? 1 : (chunks > 256 ? 256 : chunks);
}
// Working memory a backward kernel needs beyond its outputs, in elements of
// T; the caller allocates it on the kernel's device.
inline int64_t layer_norm_backward_workspace(int64_t rows, int64_t cols) {
  return 2 * layer_norm_row_chunks(rows) * cols;
}
inline int64_t attention_backward_workspace(int64_t heads, int64_t t) { return heads * t; }

// Where the rows of one attention operand lie: row i of head h, where
// h = b × heads_per_batch + j (batch entry b, head j), starts at element
// b × batch + j × head + i × row, and its head-size elements follow it.
struct HeadRows {
  int64_t batch = 0, head = 0, row = 0;
  LEASEHOLD_HOST_DEVICE int64_t at(int64_t h, int64_t i, int64_t heads_per_batch) const {
    return h / heads_per_batch * batch + h % heads_per_batch * head + i * row;
  }
};

// The rows of q, k, v and o (the output, and the layout of its gradient);
// the gradients of q, k and v are written where q, k and v are read from.
// log-sum-exp and backward's workspace are always [heads, t].
struct AttentionLayout {
  int64_t heads_per_batch = 1;
  HeadRows q, k, v, o;
};

// Every operand its own contiguous [batch, heads_per_batch, t, d].
inline AttentionLayout contiguous_attention(int64_t heads_per_batch, int64_t t, int64_t d) {
  const HeadRows rows{heads_per_batch * t * d, t * d, d};
  return {heads_per_batch, rows, rows, rows, rows};
}

// q, k and v read in place from a fused projection's output [batch, t, 3,
// heads_per_batch, d] (q starts at its element 0, k at heads_per_batch × d,
// v at twice that) and the output written with its heads merged, [batch,
// t, heads_per_batch, d]: no copies in either direction.
inline AttentionLayout packed_attention(int64_t heads_per_batch, int64_t t, int64_t d) {
  const int64_t c = heads_per_batch * d;
  const HeadRows in{t * 3 * c, d, 3 * c}, out{t * c, d, c};
  return {heads_per_batch, in, in, in, out};
}

#define LEASEHOLD_TRANSFORMER_KERNELS(NS)                                                      \
  namespace NS {                                                                              \
  /* y = (x - mean) * rstd * w + b over the last dimension of x [rows, cols];                 \
     mean and rstd [rows] are kept for backward. */                                           \
  template <class T>                                                                          \
  void layer_norm_forward(Stream s, T* y, T* mean, T* rstd, const T* x, const T* w,           \
                          const T* b, int64_t rows, int64_t cols, double eps);                \
  /* dx [rows, cols], dw and db [cols] (overwritten, summed in a fixed order: the same        \
     bits every run). dx_plus, when not null, is added to dx as it is written (another        \
     consumer's gradient of x; rounded as a separate addition would round it); dx may be     \
     dx_plus (each element is read before it is written). */                                 \
  template <class T>                                                                          \
  void layer_norm_backward(Stream s, T* dx, const T* dx_plus, T* dw, T* db, T* workspace,     \
                           const T* dy, const T* x, const T* w, const T* mean,                \
                           const T* rstd, int64_t rows, int64_t cols);                        \
  /* Scaled dot-product attention over `heads` (batch x heads) of t rows of d, laid out as   \
     `at` says, causal (query i sees keys j <= i) or not: o = softmax(q kᵀ · scale) v, and    \
     lse [heads, t] the log-sum-exp of each row of scores. No [t, t] matrix is stored. */     \
  template <class T>                                                                          \
  void attention_forward(Stream s, T* o, T* lse, const T* q, const T* k, const T* v,          \
                         const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,      \
                         double scale, bool causal);                                          \
  /* dq, dk, dv (every row overwritten) from do, recomputing the scores from q, k and lse. */ \
  template <class T>                                                                          \
  void attention_backward(Stream s, T* dq, T* dk, T* dv, T* workspace, const T* dout,         \
                          const T* q, const T* k, const T* v, const T* o, const T* lse,       \
                          const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,     \
                          double scale, bool causal);                                         \
  }

// Explicit instantiations: layer norm's (layer_norm.cu), attention's
// (attention.cu), both (transformer_cpu.cpp).
#define LEASEHOLD_LAYER_NORM_INSTANCES(T)                                                         \
  template void layer_norm_forward<T>(Stream, T*, T*, T*, const T*, const T*, const T*, int64_t, \
                                      int64_t, double);                                         \
  template void layer_norm_backward<T>(Stream, T*, const T*, T*, T*, T*, const T*, const T*,     \
                                       const T*, const T*, const T*, int64_t, int64_t);
#define LEASEHOLD_ATTENTION_INSTANCES(T)                                                          \
  template void attention_forward<T>(Stream, T*, T*, const T*, const T*, const T*,              \
                                     const AttentionLayout&, int64_t, int64_t, int64_t, double,   \
                                     bool);                                                     \
  template void attention_backward<T>(Stream, T*, T*, T*, T*, const T*, const T*, const T*,      \
                                      const T*, const T*, const T*, const AttentionLayout&,      \
                                      int64_t, int64_t, int64_t, double, bool);
#define LEASEHOLD_TRANSFORMER_INSTANCES(T) \
  LEASEHOLD_LAYER_NORM_INSTANCES(T)        \
  LEASEHOLD_ATTENTION_INSTANCES(T)

LEASEHOLD_TRANSFORMER_KERNELS(cpu)
#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_TRANSFORMER_KERNELS(cuda)
namespace cuda {
// layer_norm_forward and layer_norm_backward under autocast, for a y that
// only a bfloat16 product reads: y is written in bfloat16 (half the bytes,
// and no copy for the product to make), so its gradient dy comes back in
// bfloat16 too, as PyTorch's autocast rounds it. x, the statistics, dx, dw
// and db stay float32, and every sum runs in float32. With add_dw
// (add_db), dw (db) is added to what it holds (a gradient's sum so far),
// rounded as a separate addition after would round it.
void layer_norm_forward_bf16(Stream s, bfloat16* y, float* mean, float* rstd, const float* x,
                             const float* w, const float* b, int64_t rows, int64_t cols,
                             double eps);
void layer_norm_backward_bf16(Stream s, float* dx, const float* dx_plus, float* dw, float* db,
                              float* workspace, const bfloat16* dy, const float* x,
                              const float* w, const float* mean, const float* rstd, int64_t rows,
                              int64_t cols, bool add_dw = false, bool add_db = false);
// The largest head size the CUDA attention kernels take.
inline constexpr int64_t kMaxCudaHeadSize = 128;
// attention_forward and attention_backward under autocast
// (attention_bf16.cu): the products on tensor cores in bfloat16 with
// float32 accumulation. The activations (q, k, v, o, dout and the
// gradients) are T: float32, rounded to bfloat16 as they are read, or
// bfloat16 (a projection's output kept so), read as they are and written
// rounded once from float32. The probabilities and their gradients are
// rounded to bfloat16 before the products that take them; the softmax
// statistics (lse, and the workspace's row dot products) are float32, and
// every sum runs in a fixed order (the same bits every run).
template <class T>
void attention_forward_bf16(Stream s, T* o, float* lse, const T* q, const T* k, const T* v,
                            const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,
                            double scale, bool causal);
template <class T>
void attention_backward_bf16(Stream s, T* dq, T* dk, T* dv, float* workspace, const T* dout,
                             const T* q, const T* k, const T* v, const T* o, const float* lse,
                             const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,
                             double scale, bool causal);
}  // namespace cuda
#endif
#undef LEASEHOLD_TRANSFORMER_KERNELS

}  // namespace leasehold::kernels
