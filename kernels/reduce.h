// Row kernels: the input is contiguous [outer, inner] and each of the `outer`
// rows is reduced or normalized on its own. The op layer permutes reduced
// dimensions to the end first, so every reduction comes through here.
#pragma once

#include <cstdint>

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace leasehold::kernels {

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
// Returns how many labels lie outside [0, inner) (their loss is NaN).
template <class T>
int64_t cross_entropy_rows(T* loss, T* lse, const T* logits, const int64_t* labels,
                           int64_t outer, int64_t inner);
// gin[r, c] = (exp(logits[r, c] - lse[r]) - (c == labels[r])) * scale.
template <class T>
void cross_entropy_backward_rows(T* gin, const T* logits, const T* lse, const int64_t* labels,
                                 T scale, int64_t outer, int64_t inner);
}  // namespace cpu

#ifdef LEASEHOLD_HAVE_CUDA
// The same functions enqueued on `stream`; cross_entropy_rows adds the count
// of bad labels to the device integer *bad.
namespace cuda {
template <class T>
void sum_rows(T* out, const T* in, int64_t outer, int64_t inner, cudaStream_t stream);
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
                        int64_t inner, int* bad, cudaStream_t stream);
template <class T>
void cross_entropy_backward_rows(T* gin, const T* logits, const T* lse, const int64_t* labels,
                                 T scale, int64_t outer, int64_t inner, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace leasehold::kernels
