#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/block_reduce.cuh"
#include "kernels/elementwise_ops.h"
#include "kernels/launch.cuh"
#include "kernels/reduce.h"
#include "kernels/sum_parts.cuh"

namespace leasehold::kernels::cuda {
namespace {

constexpr int kRowBlock = 256;
// Rows are split over several blocks when there are too few rows to fill the
// GPU; each block handles at least this many elements of its row.
constexpr int64_t kChunk = kSumChunk;
// Rows up to this long are summed by one warp each rather than one block.
constexpr int64_t kShortRow = 2048;

unsigned row_grid(int64_t outer) {
  return static_cast<unsigned>(std::clamp<int64_t>(outer, 1, 65535));
}

// partial[r * parts + p] = sum of chunk p (of `chunk` elements) of row r;
// one block per (r, p).
template <class T>
__global__ void sum_chunks_kernel(T* partial, const T* in, int64_t outer, int64_t inner,
                                  int64_t parts, int64_t chunk) {
  for (int64_t job = blockIdx.x; job < outer * parts; job += gridDim.x) {
    int64_t r = job / parts, p = job % parts;
    int64_t begin = p * chunk, end = min(inner, begin + chunk);
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

// The same over 16-byte words, for rows of whole words (inner a multiple
// of the lanes, `in` 16-byte aligned).
template <class T>
__global__ void sum_chunks_words_kernel(T* partial, const T* in, int64_t outer, int64_t inner,
                                        int64_t parts) {
  constexpr int kLanes = Word<T>::kLanes;
  const int64_t row_words = inner / kLanes, chunk_words = kChunk / kLanes;
  for (int64_t job = blockIdx.x; job < outer * parts; job += gridDim.x) {
    int64_t r = job / parts, p = job % parts;
    int64_t begin = p * chunk_words, end = min(row_words, begin + chunk_words);
    const Word<T>* row = reinterpret_cast<const Word<T>*>(in + r * inner);
    T a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    const int64_t step = blockDim.x;
    int64_t i = begin + threadIdx.x;
    for (; i + 3 * step < end; i += 4 * step) {
      Word<T> x0 = row[i], x1 = row[i + step], x2 = row[i + 2 * step], x3 = row[i + 3 * step];
#pragma unroll
      for (int j = 0; j < kLanes; ++j) {
        a0 += x0.v[j];
        a1 += x1.v[j];
        a2 += x2.v[j];
        a3 += x3.v[j];
      }
    }
    for (; i < end; i += step) {
      Word<T> x = row[i];
#pragma unroll
      for (int j = 0; j < kLanes; ++j) a0 += x.v[j];
    }
    T acc = block_sum((a0 + a1) + (a2 + a3));
    if (threadIdx.x == 0) partial[job] = acc;
  }
}

// Short rows: one warp per row (no block-wide synchronization), in 16-byte
// words when `words` (inner a multiple of the lanes, `in` aligned).
template <class T, bool words>
__global__ void sum_short_rows_kernel(T* out, const T* in, int64_t outer, int64_t inner) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t r = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; r < outer;
       r += warps) {
    T a0 = 0, a1 = 0;
    if constexpr (words) {
      constexpr int kLanes = Word<T>::kLanes;
      const Word<T>* row = reinterpret_cast<const Word<T>*>(in + r * inner);
      const int64_t n = inner / kLanes;
      int64_t i = lane;
      // Four words per lane in flight (a row of 1024 floats: two turns).
      for (; i + 96 < n; i += 128) {
        Word<T> x = row[i], y = row[i + 32], z = row[i + 64], w = row[i + 96];
#pragma unroll
        for (int j = 0; j < kLanes; ++j) {
          a0 += x.v[j] + z.v[j];
          a1 += y.v[j] + w.v[j];
        }
      }
      for (; i < n; i += 32) {
        Word<T> x = row[i];
#pragma unroll
        for (int j = 0; j < kLanes; ++j) a0 += x.v[j];
      }
    } else {
      const T* row = in + r * inner;
      for (int64_t i = lane; i < inner; i += 32) a0 += row[i];
    }
    T acc = warp_sum(a0 + a1);
    if (lane == 0) out[r] = acc;
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
                                              const int64_t* labels, T scale, const T* grad,
                                              int64_t outer, int64_t inner) {
  int64_t n = outer * inner;
  scale *= *grad;
  for (int64_t k = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; k < n;
       k += int64_t(gridDim.x) * blockDim.x) {
    int64_t r = k / inner, c = k % inner;
    T p = exp(logits[k] - lse[r]);
    gin[k] = (p - (c == labels[r] ? T(1) : T(0))) * scale;
  }
}

// ColumnSums: blockDim (32, kColumnLanes), a block per 32 columns. Each row
// lane loads four rows before it adds (and stores the masked values), so
// four loads are in flight; the lanes meet in shared memory in a fixed
// order (deterministic).
constexpr int kColumnLanes = 32;
template <class T, bool kMasked>
__global__ void __launch_bounds__(32 * kColumnLanes) sum_columns_kernel(ColumnSums<T> s) {
  __shared__ T lanes[kColumnLanes][32];
  const int64_t c = blockIdx.x * int64_t(32) + threadIdx.x;
  const T* __restrict__ in = s.in;
  const T* __restrict__ mask = s.mask;
  T* __restrict__ masked = s.masked;
  T acc[4] = {0, 0, 0, 0};
  const int64_t first = s.part_rows ? blockIdx.y * s.part_rows : 0;
  const int64_t end = s.part_rows ? min(s.rows, first + s.part_rows) : s.rows;
  if (c < s.columns) {
    for (int64_t r0 = first + threadIdx.y; r0 < end; r0 += 4 * kColumnLanes) {
      T v[4], m[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t r = r0 + u * kColumnLanes;
        v[u] = r < end ? in[r * s.columns + c] : T(0);
        if constexpr (kMasked) m[u] = r < end ? mask[r * s.columns + c] : T(0);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        if constexpr (kMasked) {
          const int64_t r = r0 + u * kColumnLanes;
          v[u] = m[u] > T(0) ? v[u] : T(0);
          if (masked && r < end) masked[r * s.columns + c] = v[u];
        }
        acc[u] += v[u];
      }
    }
  }
  lanes[threadIdx.y][threadIdx.x] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  __syncthreads();
  if (threadIdx.y != 0 || c >= s.columns) return;
  T sum = 0;
  for (int l = 0; l < kColumnLanes; ++l) sum += lanes[l][threadIdx.x];
  if (s.part_rows) {
    s.out[blockIdx.y * s.columns + c] = sum;
  } else if (s.tail && c >= s.tail_from) {
    s.tail[c - s.tail_from] = sum * s.scale;
  } else {
    s.out[c] = sum * s.scale;
  }
}

// ---- bfloat16 column sums ----

// Rows per part of column_sums_bf16's first pass, and the part count's
// bound: a count fixed by the shape, so the order of the sums is too.
constexpr int64_t kBf16PartRows = 64, kBf16MaxParts = 256;
constexpr int kBf16RowLanes = 8;

int64_t bf16_parts(int64_t rows) {
  return std::clamp<int64_t>((rows + kBf16PartRows - 1) / kBf16PartRows, 1, kBf16MaxParts);
}

// partial[p][c] over part p's rows: a block of 32 threads along the columns
// (W columns each, one 16-byte load when W is 8) × kBf16RowLanes along the
// rows, the lanes summed in order. kGelu: what is summed is GELU's
// backward of in (its gradient) at gelu_input, written to dx as it goes.
template <int W, bool kGelu>
__global__ void __launch_bounds__(32 * kBf16RowLanes)
    column_sums_bf16_partial_kernel(float* partial, const bfloat16* in, int64_t rows,
                                    int64_t columns, int64_t parts, bfloat16* dx,
                                    const bfloat16* gelu_input) {
  __shared__ float lanes[kBf16RowLanes][32 * W + 1];
  const int64_t c0 = (blockIdx.x * int64_t(32) + threadIdx.x) * W;
  const int64_t p = blockIdx.y, per = (rows + parts - 1) / parts;
  const int64_t begin = p * per, end = min(rows, begin + per);
  float acc[W] = {};
  if (c0 < columns) {
#pragma unroll 4
    for (int64_t r = begin + threadIdx.y; r < end; r += kBf16RowLanes) {
      const int64_t at = r * columns + c0;
      if constexpr (W == 8) {
        uint4 word = *reinterpret_cast<const uint4*>(in + at);
        bfloat16* v = reinterpret_cast<bfloat16*>(&word);
        if constexpr (kGelu) {
          const uint4 xw = *reinterpret_cast<const uint4*>(gelu_input + at);
          const bfloat16* xv = reinterpret_cast<const bfloat16*>(&xw);
#pragma unroll
          for (int j = 0; j < 8; ++j) v[j] = gelu_grad_bf16(v[j], xv[j]);
          *reinterpret_cast<uint4*>(dx + at) = word;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[j] += float(v[j]);
      } else {
        bfloat16 v = in[at];
        if constexpr (kGelu) {
          v = gelu_grad_bf16(v, gelu_input[at]);
          dx[at] = v;
        }
        acc[0] += float(v);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < W; ++j) lanes[threadIdx.y][threadIdx.x * W + j] = acc[j];
  __syncthreads();
  // Lane row 0 writes the block's columns, a column a thread per step.
  if (threadIdx.y != 0) return;
  for (int j = threadIdx.x; j < 32 * W; j += 32) {
    const int64_t c = blockIdx.x * int64_t(32) * W + j;
    if (c >= columns) break;
    float sum = 0.f;
    for (int l = 0; l < kBf16RowLanes; ++l) sum += lanes[l][j];
    partial[p * columns + c] = sum;
  }
}

}  // namespace

template <class T>
void sum_columns(Stream queue, const ColumnSums<T>& s) {
  cudaStream_t stream = as_cuda(queue);
  if (s.columns == 0) return;
  const int64_t blocks = (s.columns + 31) / 32;
  const int64_t parts = s.part_rows ? (s.rows + s.part_rows - 1) / s.part_rows : 1;
  if (blocks > 0x7fffffff) throw std::invalid_argument("sum_columns: too many columns");
  if (parts > 65535) {
    throw std::invalid_argument("sum_columns: " + std::to_string(parts) + " parts of " +
                                std::to_string(s.part_rows) + " rows, over the grid's 65535");
  }
  if (s.part_rows && (s.mask || s.tail)) {
    throw std::invalid_argument("sum_columns: partial sums take no mask and no tail");
  }
  const dim3 grid{unsigned(blocks), unsigned(parts)};
  if (s.mask) {
    sum_columns_kernel<T, true><<<grid, dim3(32, kColumnLanes), 0, stream>>>(s);
  } else {
    sum_columns_kernel<T, false><<<grid, dim3(32, kColumnLanes), 0, stream>>>(s);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

int64_t column_sums_bf16_workspace(int64_t rows, int64_t columns) {
  return bf16_parts(rows) * columns;
}

namespace {

template <bool kGelu>
void launch_column_sums_bf16(cudaStream_t stream, float* out, float* workspace,
                             const bfloat16* in, int64_t rows, int64_t columns, bfloat16* dx,
                             const bfloat16* gelu_input, bool add) {
  if (columns == 0) return;
  const int64_t parts = bf16_parts(rows);
  const auto word_aligned = [](const void* p) {
    return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0;
  };
  const bool words =
      columns % 8 == 0 && word_aligned(in) && word_aligned(dx) && word_aligned(gelu_input);
  const int64_t per_block = words ? 32 * 8 : 32;
  const dim3 grid{static_cast<unsigned>((columns + per_block - 1) / per_block),
                  static_cast<unsigned>(parts)};
  if (words) {
    column_sums_bf16_partial_kernel<8, kGelu><<<grid, dim3(32, kBf16RowLanes), 0, stream>>>(
        workspace, in, rows, columns, parts, dx, gelu_input);
  } else {
    column_sums_bf16_partial_kernel<1, kGelu><<<grid, dim3(32, kBf16RowLanes), 0, stream>>>(
        workspace, in, rows, columns, parts, dx, gelu_input);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  sum_parts_kernel<float><<<static_cast<unsigned>((columns + 31) / 32), 32 * kPartLanes, 0,
                             stream>>>(out, nullptr, workspace, columns, parts, add);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void column_sums_bf16(Stream s, float* out, float* workspace, const bfloat16* in, int64_t rows,
                      int64_t columns, bool add) {
  launch_column_sums_bf16<false>(as_cuda(s), out, workspace, in, rows, columns, nullptr,
                                 nullptr, add);
}

void gelu_backward_column_sums_bf16(Stream s, bfloat16* dx, float* out, float* workspace,
                                    const bfloat16* g, const bfloat16* x, int64_t rows,
                                    int64_t columns, bool add) {
  launch_column_sums_bf16<true>(as_cuda(s), out, workspace, g, rows, columns, dx, x, add);
}

template <class T>
void sum_rows(Stream queue, T* out, const T* in, int64_t outer, int64_t inner, T* scratch) {
  cudaStream_t stream = as_cuda(queue);
  if (outer == 0) return;
  const bool words = inner % Word<T>::kLanes == 0 && aligned16(in);
  if (inner <= kShortRow) {
    const int64_t blocks = (outer + kRowBlock / 32 - 1) / (kRowBlock / 32);
    if (words) {
      sum_short_rows_kernel<T, true><<<row_grid(blocks), kRowBlock, 0, stream>>>(out, in, outer,
                                                                                 inner);
    } else {
      sum_short_rows_kernel<T, false><<<row_grid(blocks), kRowBlock, 0, stream>>>(out, in, outer,
                                                                                  inner);
    }
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    return;
  }
  int64_t parts = std::max<int64_t>(1, (inner + kChunk - 1) / kChunk);
  auto chunks = [&](T* dst, int64_t n_parts) {
    if (words) {
      sum_chunks_words_kernel<T><<<row_grid(outer * n_parts), kRowBlock, 0, stream>>>(
          dst, in, outer, inner, n_parts);
    } else {
      sum_chunks_kernel<T><<<row_grid(outer * n_parts), kRowBlock, 0, stream>>>(
          dst, in, outer, inner, n_parts, kChunk);
    }
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  };
  if (parts == 1) return chunks(out, 1);
  // Two passes: chunk sums into the caller's scratch, then the sum of each
  // row's chunk sums. Same order every run, so results are deterministic
  // (no atomics).
  if (!scratch) throw std::invalid_argument("sum_rows: rows this long need scratch memory");
  chunks(scratch, parts);
  // Each row's partials, all of them, by one block.
  sum_chunks_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(out, scratch, outer, parts, 1,
                                                                  parts);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void max_rows(Stream queue, T* values, int64_t* indices, const T* in, int64_t outer,
              int64_t inner) {
  cudaStream_t stream = as_cuda(queue);
  if (outer == 0) return;
  max_rows_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(values, indices, in, outer, inner);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void scatter_rows(Stream queue, T* out, const int64_t* indices, const T* values, int64_t outer,
                  int64_t inner) {
  cudaStream_t stream = as_cuda(queue);
  if (outer == 0) return;
  scatter_rows_kernel<T><<<grid_for(outer), kBlock, 0, stream>>>(out, indices, values, outer,
                                                                 inner);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void softmax_rows(Stream queue, T* out, const T* in, int64_t outer, int64_t inner, bool log) {
  cudaStream_t stream = as_cuda(queue);
  if (outer == 0) return;
  softmax_rows_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(out, in, outer, inner, log);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void softmax_backward_rows(Stream queue, T* gin, const T* g, const T* y, int64_t outer,
                           int64_t inner, bool log) {
  cudaStream_t stream = as_cuda(queue);
  if (outer == 0) return;
  softmax_backward_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(gin, g, y, outer, inner,
                                                                        log);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void cross_entropy_rows(Stream queue, T* loss, T* lse, const T* logits, const int64_t* labels,
                        int64_t outer, int64_t inner, int64_t* bad) {
  cudaStream_t stream = as_cuda(queue);
  if (outer == 0) return;
  cross_entropy_kernel<T><<<row_grid(outer), kRowBlock, 0, stream>>>(loss, lse, logits, labels,
                                                                     outer, inner, bad);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void cross_entropy_backward_rows(Stream queue, T* gin, const T* logits, const T* lse,
                                 const int64_t* labels, T scale, const T* grad, int64_t outer,
                                 int64_t inner) {
  cudaStream_t stream = as_cuda(queue);
  if (outer == 0) return;
  cross_entropy_backward_kernel<T><<<grid_for(outer * inner), kBlock, 0, stream>>>(
      gin, logits, lse, labels, scale, grad, outer, inner);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

LEASEHOLD_REDUCE_INSTANCES
template void sum_columns<float>(Stream, const ColumnSums<float>&);
template void sum_columns<double>(Stream, const ColumnSums<double>&);
template void sum_columns<int64_t>(Stream, const ColumnSums<int64_t>&);

}  // namespace leasehold::kernels::cuda
