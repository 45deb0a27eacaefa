#include <cfloat>
#include <stdexcept>

#include "kernels/block_reduce.cuh"
#include "kernels/launch.cuh"
#include "kernels/reduce.h"

namespace leasehold::kernels::cuda {
namespace {

constexpr int kRowBlock = 256;
// Rows are split over several blocks when there are too few rows to fill the
// GPU; each block handles at least this many elements of its row.
constexpr int64_t kChunk = kSumChunk;

unsigned row_grid(int64_t outer) {
  return static_cast<unsigned>(std::clamp<int64_t>(outer, 1, 65535));
}

// partial[r * parts + p] = sum of chunk p of row r; one block per (r, p).
template <class T>
__global__ void sum_chunks_kernel(T* partial, const T* in, int64_t outer, int64_t inner,
                                  int64_t parts) {
  for (int64_t job = blockIdx.x; job < outer * parts; job += gridDim.x) {
    int64_t r = job / parts, p = job % parts;
    int64_t begin = p * kChunk, end = min(inner, begin + kChunk);
    const T* row = in + r * inner;
    // Four independent accumulators keep four loads in flight per thread.
    T a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    const int64_t step = blockDim.x;
    int64_t i = begin + threadIdx.x;
    for (; i + 3 * step < end; i += 4 * step) {
      a0 += row[i];
      a1 += row[i + step];
      a2 += row[i + 2 * step];
      a3 += row[i + 3 * step];
    }
    for (; i < end; i += step) a0 += row[i];
    T acc = block_sum((a0 + a1) + (a2 + a3));
    if (threadIdx.x == 0) partial[job] = acc;
  }
}

template <class T>
__global__ void max_rows_kernel(T* values, int64_t* indices, const T* in, int64_t outer,
                                int64_t inner) {
  __shared__ T best_v[kRowBlock];
  __shared__ int64_t best_i[kRowBlock];
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* row = in + r * inner;
    T v = -INFINITY;
    int64_t idx = inner;  // "none yet"
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) {
      T x = row[i];
      bool better = idx == inner || x > v || (isnan(x) && !isnan(v));
      if (better) {
        v = x;
        idx = i;
      }
    }
    best_v[threadIdx.x] = v;
    best_i[threadIdx.x] = idx;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
      if (threadIdx.x < s) {
        T ov = best_v[threadIdx.x + s];
        int64_t oi = best_i[threadIdx.x + s];
        T mv = best_v[threadIdx.x];
        int64_t mi = best_i[threadIdx.x];
        // Larger value wins; on ties (and NaN) the first index, as on CPU.
        bool take = oi != inner &&
                    (mi == inner || ov > mv || (isnan(ov) && !isnan(mv)) ||
                     ((ov == mv || (isnan(ov) && isnan(mv))) && oi < mi));
        if (take) {
          best_v[threadIdx.x] = ov;
          best_i[threadIdx.x] = oi;
        }
      }
      __syncthreads();
    }
    if (threadIdx.x == 0) {
      values[r] = best_v[0];
      indices[r] = best_i[0];
    }
    __syncthreads();
  }
}

template <class T>
__global__ void scatter_rows_kernel(T* out, const int64_t* indices, const T* values,
                                    int64_t outer, int64_t inner) {
  for (int64_t r = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; r < outer;
       r += int64_t(gridDim.x) * blockDim.x) {
    out[r * inner + indices[r]] += values[r];
  }
}

template <class T>
__global__ void softmax_rows_kernel(T* out, const T* in, int64_t outer, int64_t inner,
                                    bool log) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* x = in + r * inner;
    T* y = out + r * inner;
    T m = -INFINITY;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) m = fmax(m, x[i]);
    m = block_max(m);
    T s = 0;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) s += exp(x[i] - m);
    s = block_sum(s);
    T lse = m + ::log(s);
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) {
      y[i] = log ? x[i] - lse : exp(x[i] - lse);
    }
  }
}

template <class T>
__global__ void softmax_backward_kernel(T* gin, const T* g, const T* y, int64_t outer,
                                        int64_t inner, bool log) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* gr = g + r * inner;
    const T* yr = y + r * inner;
    T dot = 0;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) dot += log ? gr[i] : gr[i] * yr[i];
    dot = block_sum(dot);
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) {
      gin[r * inner + i] = log ? gr[i] - exp(yr[i]) * dot : yr[i] * (gr[i] - dot);
    }
  }
}

template <class T>
__global__ void cross_entropy_kernel(T* loss, T* lse_out, const T* logits, const int64_t* labels,
                                     int64_t outer, int64_t inner, int64_t* bad) {
  for (int64_t r = blockIdx.x; r < outer; r += gridDim.x) {
    const T* x = logits + r * inner;
    T m = -INFINITY;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) m = fmax(m, x[i]);
    m = block_max(m);
    T s = 0;
    for (int64_t i = threadIdx.x; i < inner; i += blockDim.x) s += exp(x[i] - m);
    s = block_sum(s);
    if (threadIdx.x == 0) {
      T lse = m + ::log(s);
      lse_out[r] = lse;
      int64_t y = labels[r];
      if (y < 0 || y >= inner) {
        atomicAdd(reinterpret_cast<unsigned long long*>(bad), 1ull);
        atomicExch(reinterpret_cast<unsigned long long*>(bad + 1), static_cast<unsigned long long>(y));
        loss[r] = T(NAN);
      } else {
        loss[r] = lse - x[y];
      }
    }
  }
}

template <class T>
__global__ void cross_entropy_backward_kernel(T* gin, const T* logits, const T* lse,
                                              const int64_t* labels, T scale, int64_t outer,
                                              int64_t inner) {
  int64_t n = outer * inner;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    int64_t r = k / inner, c = k % inner;
    T p = exp(logits[k] - lse[r]);
    gin[k] = (p - (c == labels[r] ? T(1) : T(0))) * scale;
  }
}

}  // namespace

template <class T>
void sum_rows(T* out, const T* in, int64_t outer, int64_t inner, T* scratch,
              cudaStream_t stream) {
  if (outer == 0) return;
  int64_t parts = std::max<int64_t>(1, (inner + kChunk - 1) / kChunk);
  if (parts == 1) {
    sum_chunks_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(out, in, outer, inner, 1);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    return;
  }
  // Two passes: chunk sums into the caller's scratch, then the sum of each
  // row's chunk sums. Same order every run, so results are deterministic
  // (no atomics).
  if (!scratch) throw std::invalid_argument("sum_rows: rows this long need scratch memory");
  sum_chunks_kernel<T><<<row_grid(outer * parts), kRowBlock, 0, stream>>>(scratch, in, outer,
                                                                          inner, parts);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  sum_chunks_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(out, scratch, outer, parts, 1);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void max_rows(T* values, int64_t* indices, const T* in, int64_t outer, int64_t inner,
              cudaStream_t stream) {
  if (outer == 0) return;
  max_rows_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(values, indices, in, outer, inner);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void scatter_rows(T* out, const int64_t* indices, const T* values, int64_t outer, int64_t inner,
                  cudaStream_t stream) {
  if (outer == 0) return;
  scatter_rows_kernel<T><<<grid_for(outer), kBlock, 0, stream>>>(out, indices, values, outer,
                                                                 inner);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void softmax_rows(T* out, const T* in, int64_t outer, int64_t inner, bool log,
                  cudaStream_t stream) {
  if (outer == 0) return;
  softmax_rows_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(out, in, outer, inner, log);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void softmax_backward_rows(T* gin, const T* g, const T* y, int64_t outer, int64_t inner,
                           bool log, cudaStream_t stream) {
  if (outer == 0) return;
  softmax_backward_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(gin, g, y, outer, inner,
                                                                        log);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void cross_entropy_rows(T* loss, T* lse, const T* logits, const int64_t* labels, int64_t outer,
                        int64_t inner, int64_t* bad, cudaStream_t stream) {
  if (outer == 0) return;
  cross_entropy_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(loss, lse, logits, labels,
                                                                     outer, inner, bad);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void cross_entropy_backward_rows(T* gin, const T* logits, const T* lse, const int64_t* labels,
                                 T scale, int64_t outer, int64_t inner, cudaStream_t stream) {
  if (outer == 0) return;
  cross_entropy_backward_kernel<T><<<grid_for(outer * inner), kBlock, 0, stream>>>(
      gin, logits, lse, labels, scale, outer, inner);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

#define LEASEHOLD_INSTANTIATE(T)                                                              \
  template void sum_rows<T>(T*, const T*, int64_t, int64_t, T*, cudaStream_t);                \
  template void max_rows<T>(T*, int64_t*, const T*, int64_t, int64_t, cudaStream_t);          \
  template void scatter_rows<T>(T*, const int64_t*, const T*, int64_t, int64_t, cudaStream_t); \
  template void softmax_rows<T>(T*, const T*, int64_t, int64_t, bool, cudaStream_t);          \
  template void softmax_backward_rows<T>(T*, const T*, const T*, int64_t, int64_t, bool,      \
                                         cudaStream_t);                                       \
  template void cross_entropy_rows<T>(T*, T*, const T*, const int64_t*, int64_t, int64_t,     \
                                      int64_t*,                                               \
                                      cudaStream_t);                                          \
  template void cross_entropy_backward_rows<T>(T*, const T*, const T*, const int64_t*, T,      \
                                               int64_t, int64_t, cudaStream_t);
LEASEHOLD_INSTANTIATE(float)
LEASEHOLD_INSTANTIATE(double)
#undef LEASEHOLD_INSTANTIATE
template void sum_rows<int64_t>(int64_t*, const int64_t*, int64_t, int64_t, int64_t*,
                                cudaStream_t);

}  // namespace leasehold::kernels::cuda
