// Row kernels: the input is contiguous [outer, inner] and each of the `outer`
// rows is reduced or normalized on its own. The op layer permutes reduced
// dimensions to the end first, except for column sums (below).
#pragma once

#include <cstdint>

#include "kernels/bfloat16.h"
#include "kernels/stream.h"

namespace leasehold::kernels {

// Column sums of a contiguous [rows, columns] (CUDA: cuda::sum_columns): a
// sum over leading dimensions (a batch's bias gradient, partial sums, a
// mean) without moving them last first. One pass for up to kMaxColumnRows
// rows; more in parts (part_rows), then a pass over the parts.
inline constexpr int64_t kMaxColumnRows = 4096;
template <class T>
struct ColumnSums {
  T* out = nullptr;  // out[c] = scale · sum over r of in[r, c]
  const T* in = nullptr;
  int64_t rows = 0, columns = 0;
  T scale = 1;
  // A ReLU's backward folded in: in[r, c] counts only where mask[r, c] > 0,
  // and the masked input is written to `masked` (when not null).
  const T* mask = nullptr;
  T* masked = nullptr;
  // Columns from tail_from on go to tail[c - tail_from] instead (a weight
  // and a bias gradient from one sum, in buffers of their own).
  T* tail = nullptr;
  int64_t tail_from = 0;
  // Partial sums (CUDA): when set, rows [p · part_rows, (p + 1) · part_rows)
  // are summed into out[p · columns + c] for each part p (no tail): many
  // rows spread over more blocks, the parts then summed in a second pass.
  int64_t part_rows = 0;
};

// Elements of one CUDA sum_rows pass over a row; longer rows are summed in
// two, through sum_rows_scratch(outer, inner) elements of scratch that the
// caller allocates on the kernel's device (a job's come from its leases).
// The CPU needs none and ignores it.
inline constexpr int64_t kSumChunk = 16384;
inline int64_t sum_rows_scratch(int64_t outer, int64_t inner) {
  const int64_t parts = (inner + kSumChunk - 1) / kSumChunk;
  return parts > 1 ? outer * parts : 0;
}

#define LEASEHOLD_REDUCE_KERNELS(NS)                                                          \
  namespace NS {                                                                             \
  /* out[r] = sum of row r. */                                                               \
  template <class T>                                                                         \
  void sum_rows(Stream s, T* out, const T* in, int64_t outer, int64_t inner, T* scratch);    \
  /* values[r], indices[r] = maximum and its first index in row r. */                        \
  template <class T>                                                                         \
  void max_rows(Stream s, T* values, int64_t* indices, const T* in, int64_t outer,           \
                int64_t inner);                                                              \
  /* out[r, indices[r]] += values[r], out being [outer, inner]. */                          \
  template <class T>                                                                         \
  void scatter_rows(Stream s, T* out, const int64_t* indices, const T* values, int64_t outer, \
                    int64_t inner);                                                          \
  /* softmax, or log_softmax when `log`, of each row. */                                     \
  template <class T>                                                                         \
  void softmax_rows(Stream s, T* out, const T* in, int64_t outer, int64_t inner, bool log);  \
  /* Gradient from output grad g and forward output y: y * (g - sum(g * y)), or for         \
     log_softmax g - exp(y) * sum(g). */                                                     \
  template <class T>                                                                         \
  void softmax_backward_rows(Stream s, T* gin, const T* g, const T* y, int64_t outer,        \
                             int64_t inner, bool log);                                       \
  /* loss[r] = logsumexp(row r) - logits[r, labels[r]], lse[r] = logsumexp(row r). Labels   \
     outside [0, inner) get a NaN loss; their count is added to bad[0] and one of them is    \
     stored in bad[1] (two int64s on the kernel's device, so CUDA never waits for the        \
     host). */                                                                               \
  template <class T>                                                                         \
  void cross_entropy_rows(Stream s, T* loss, T* lse, const T* logits, const int64_t* labels, \
                          int64_t outer, int64_t inner, int64_t* bad);                       \
  /* gin[r, c] = (exp(logits[r, c] - lse[r]) - (c == labels[r])) * scale · *grad (the      \
     loss's incoming gradient, a scalar in the same memory). */                              \
  template <class T>                                                                         \
  void cross_entropy_backward_rows(Stream s, T* gin, const T* logits, const T* lse,          \
                                   const int64_t* labels, T scale, const T* grad,            \
                                   int64_t outer, int64_t inner);                            \
  }

// Explicit instantiations, expanded in reduce_cpu.cpp and reduce.cu.
#define LEASEHOLD_REDUCE_INSTANCES_OF(T)                                                      \
  template void sum_rows<T>(Stream, T*, const T*, int64_t, int64_t, T*);                     \
  template void max_rows<T>(Stream, T*, int64_t*, const T*, int64_t, int64_t);               \
  template void scatter_rows<T>(Stream, T*, const int64_t*, const T*, int64_t, int64_t);     \
  template void softmax_rows<T>(Stream, T*, const T*, int64_t, int64_t, bool);               \
  template void softmax_backward_rows<T>(Stream, T*, const T*, const T*, int64_t, int64_t,   \
                                         bool);                                              \
  template void cross_entropy_rows<T>(Stream, T*, T*, const T*, const int64_t*, int64_t,     \
                                      int64_t, int64_t*);                                    \
  template void cross_entropy_backward_rows<T>(Stream, T*, const T*, const T*,               \
                                               const int64_t*, T, const T*, int64_t, int64_t);
#define LEASEHOLD_REDUCE_INSTANCES  \
  LEASEHOLD_REDUCE_INSTANCES_OF(float)  \
  LEASEHOLD_REDUCE_INSTANCES_OF(double) \
  template void sum_rows<int64_t>(Stream, int64_t*, const int64_t*, int64_t, int64_t, int64_t*);

LEASEHOLD_REDUCE_KERNELS(cpu)
#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_REDUCE_KERNELS(cuda)
namespace cuda {
// Column sums (above), CUDA only: the fast path for sums over leading
// dimensions, where the CPU transposes and sums rows.
template <class T>
void sum_columns(Stream s, const ColumnSums<T>& sums);

// out [columns] (float32) = the column sums of a bfloat16 [rows, columns]
// (a bias's gradient under autocast), summed in float32 in a fixed order:
// parts of rows into `workspace` (column_sums_bf16_workspace elements),
// then the parts. Rows of a multiple of 8 columns that start 16-byte
// aligned are read 8 columns a thread a load. With `add`, the sums are
// added to what out holds (a gradient's sum so far), rounded as a separate
// addition after would round them.
int64_t column_sums_bf16_workspace(int64_t rows, int64_t columns);
void column_sums_bf16(Stream s, float* out, float* workspace, const bfloat16* in, int64_t rows,
                      int64_t columns, bool add = false);
// The same sums of GELU's backward, dx = g · gelu'(x) (tanh form, in
// float32, rounded to bfloat16 as elementwise.h's gelu_backward_bf16
// rounds it), written to dx [rows, columns] as it is summed: a product's
// fused GELU and its bias's gradient in one pass over g and x. dx may be
// g (each element is read before it is written). Rows of a multiple of 8
// columns go 8 at a time where dx, g and x start 16-byte aligned.
void gelu_backward_column_sums_bf16(Stream s, bfloat16* dx, float* out, float* workspace,
                                    const bfloat16* g, const bfloat16* x, int64_t rows,
                                    int64_t columns, bool add = false);
}  // namespace cuda
#endif
#undef LEASEHOLD_REDUCE_KERNELS

}  // namespace leasehold::kernels
