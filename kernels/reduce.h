// Row kernels: the input is contiguous [outer, inner] and each of the `outer`
// rows is reduced or normalized on its own. The op layer permutes reduced
// dimensions to the end first, except for column sums (below).
#pragma once

#include <cstdint>

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace leasehold::kernels {

// Column sums of a contiguous [rows, columns] (CUDA: cuda::sum_columns): a
// sum over leading dimensions (a batch's bias gradient, partial sums, a
// mean) without moving them last first. For up to kMaxColumnRows rows;
// more are better served by sum_rows over the transposed tensor, which
// spreads rows over blocks.
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
};

namespace cpu {
// out[r] = sum of row r.
template <class T>
void sum_rows(T* out, const T* in, int64_t outer, int64_t inner);
// values[r], indices[r] = maximum and its first index in row r.
template <class T>
void max_rows(T* values, int64_t* indices, const T* in, int64_t outer, int64_t inner);
// out[r, indices[r]] += values[r], out being [outer, inner].
template <class T>
void scatter_rows(T* out, const int64_t* indices, const T* values, int64_t outer, int64_t inner);
// softmax, or log_softmax when `log`, of each row.
template <class T>
void softmax_rows(T* out, const T* in, int64_t outer, int64_t inner, bool log);
// Gradient from output grad g and forward output y: y * (g - sum(g * y)), or
// for log_softmax g - exp(y) * sum(g).
template <class T>
void softmax_backward_rows(T* gin, const T* g, const T* y, int64_t outer, int64_t inner,
                           bool log);
// loss[r] = logsumexp(row r) - logits[r, labels[r]], lse[r] = logsumexp(row r).
// Returns how many labels lie outside [0, inner) (their loss is NaN), and
// one of them in *bad_label when there are any.
template <class T>
int64_t cross_entropy_rows(T* loss, T* lse, const T* logits, const int64_t* labels,
                           int64_t outer, int64_t inner, int64_t* bad_label);
// gin[r, c] = (exp(logits[r, c] - lse[r]) - (c == labels[r])) * scale · *grad
// (the loss's incoming gradient, a scalar in the same memory).
template <class T>
void cross_entropy_backward_rows(T* gin, const T* logits, const T* lse, const int64_t* labels,
                                 T scale, const T* grad, int64_t outer, int64_t inner);
}  // namespace cpu

#ifdef LEASEHOLD_HAVE_CUDA
// The same functions enqueued on `stream`. cross_entropy_rows adds the
// count of bad labels to bad[0] and stores one of them in bad[1] (two
// device int64s). sum_rows needs sum_rows_scratch(outer, inner) elements of
// device scratch (the caller's memory: a job's comes from its leases).
namespace cuda {
// Elements of one sum_rows pass over a row; longer rows are summed in two.
inline constexpr int64_t kSumChunk = 16384;
inline int64_t sum_rows_scratch(int64_t outer, int64_t inner) {
  const int64_t parts = (inner + kSumChunk - 1) / kSumChunk;
  return parts > 1 ? outer * parts : 0;
}
template <class T>
void sum_rows(T* out, const T* in, int64_t outer, int64_t inner, T* scratch,
              cudaStream_t stream);
template <class T>
void sum_columns(const ColumnSums<T>& s, cudaStream_t stream);
template <class T>
void max_rows(T* values, int64_t* indices, const T* in, int64_t outer, int64_t inner,
              cudaStream_t stream);
template <class T>
void scatter_rows(T* out, const int64_t* indices, const T* values, int64_t outer, int64_t inner,
                  cudaStream_t stream);
template <class T>
void softmax_rows(T* out, const T* in, int64_t outer, int64_t inner, bool log,
                  cudaStream_t stream);
template <class T>
void softmax_backward_rows(T* gin, const T* g, const T* y, int64_t outer, int64_t inner,
                           bool log, cudaStream_t stream);
template <class T>
void cross_entropy_rows(T* loss, T* lse, const T* logits, const int64_t* labels, int64_t outer,
                        int64_t inner, int64_t* bad, cudaStream_t stream);
template <class T>
void cross_entropy_backward_rows(T* gin, const T* logits, const T* lse, const int64_t* labels,
                                 T scale, const T* grad, int64_t outer, int64_t inner,
                                 cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace leasehold::kernels
