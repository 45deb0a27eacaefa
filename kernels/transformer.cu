// CUDA transformer kernels. Layer norm: a warp per row. Attention: the FlashAttention
// algorithm, one thread per query (forward, dq) or key (dk, dv) row, tiles
// of the other side staged in shared memory, an online softmax; the [t, t]
// scores are never stored.
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/attention_launch.cuh"
#include "kernels/block_reduce.cuh"
#include "kernels/launch.cuh"
#include "kernels/transformer.h"

namespace leasehold::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

unsigned warp_rows_grid(int64_t rows) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, 65535));
}

// ---- layer norm ----

template <class T>
__global__ void layer_norm_forward_kernel(T* y, T* mean, T* rstd, const T* x, const T* w,
                                          const T* b, int64_t rows, int64_t cols, T eps) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; r < rows;
       r += int64_t(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + r * cols;
    T sum = 0;
    for (int64_t c = lane; c < cols; c += 32) sum += xr[c];
    const T mu = warp_sum(sum) / T(cols);
    T sq = 0;
    for (int64_t c = lane; c < cols; c += 32) sq += (xr[c] - mu) * (xr[c] - mu);
    const T rs = T(1) / sqrt(warp_sum(sq) / T(cols) + eps);
    for (int64_t c = lane; c < cols; c += 32) y[r * cols + c] = (xr[c] - mu) * rs * w[c] + b[c];
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

template <class T>
__global__ void layer_norm_dx_kernel(T* dx, const T* dy, const T* x, const T* w, const T* mean,
                                     const T* rstd, int64_t rows, int64_t cols) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; r < rows;
       r += int64_t(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + r * cols;
    const T* gr = dy + r * cols;
    const T mu = mean[r], rs = rstd[r];
    T a = 0, bsum = 0;
    for (int64_t c = lane; c < cols; c += 32) {
      const T gw = gr[c] * w[c];
      a += gw;
      bsum += gw * (xr[c] - mu) * rs;
    }
    a = warp_sum(a) / T(cols);
    bsum = warp_sum(bsum) / T(cols);
    for (int64_t c = lane; c < cols; c += 32) {
      dx[r * cols + c] = rs * (gr[c] * w[c] - a - (xr[c] - mu) * rs * bsum);
    }
  }
}

// The dw/db kernels' blocks: 32 columns × 8 lanes. Each thread's (w, b)
// pair summed over its column's 8 lanes in lane order, into lane row 0's
// threads (true there). Every thread of the block calls it.
template <class T>
__device__ inline bool sum_lanes(T& w, T& b) {
  __shared__ T sw[8][33], sb[8][33];
  const int lane_row = threadIdx.x / 32, c = threadIdx.x % 32;
  sw[lane_row][c] = w;
  sb[lane_row][c] = b;
  __syncthreads();
  if (lane_row != 0) return false;
  w = 0;
  b = 0;
  for (int i = 0; i < 8; ++i) {
    w += sw[i][c];
    b += sb[i][c];
  }
  return true;
}

// partial[chunk][col] (dw then db halves) over the chunk's rows; a block of
// 32 columns × 8 row lanes, summed across lanes in a fixed order.
template <class T>
__global__ void layer_norm_dwdb_partial_kernel(T* partial, const T* dy, const T* x,
                                               const T* mean, const T* rstd, int64_t rows,
                                               int64_t cols, int64_t chunks) {
  const int64_t col = blockIdx.x * 32 + threadIdx.x % 32;
  const int lane_row = threadIdx.x / 32;
  const int64_t chunk = blockIdx.y;
  const int64_t per = (rows + chunks - 1) / chunks;
  const int64_t begin = chunk * per, end = min(rows, begin + per);
  T aw = 0, ab = 0;
  if (col < cols) {
    for (int64_t r = begin + lane_row; r < end; r += 8) {
      const T g = dy[r * cols + col];
      aw += g * (x[r * cols + col] - mean[r]) * rstd[r];
      ab += g;
    }
  }
  if (sum_lanes(aw, ab) && col < cols) {
    partial[chunk * cols + col] = aw;
    partial[(chunks + chunk) * cols + col] = ab;
  }
}

// dw and db from the chunks' partial sums: the same block shape, 32 columns
// × 8 lanes of chunks (a thread per column alone would walk every chunk in
// sequence, a few hundred dependent loads), lanes summed in a fixed order.
template <class T>
__global__ void layer_norm_dwdb_final_kernel(T* dw, T* db, const T* partial, int64_t cols,
                                             int64_t chunks) {
  const int64_t col = blockIdx.x * 32 + threadIdx.x % 32;
  const int lane_row = threadIdx.x / 32;
  T tw = 0, tb = 0;
  if (col < cols) {
    for (int64_t k = lane_row; k < chunks; k += 8) {
      tw += partial[k * cols + col];
      tb += partial[(chunks + k) * cols + col];
    }
  }
  if (sum_lanes(tw, tb) && col < cols) {
    dw[col] = tw;
    db[col] = tb;
  }
}

// ---- attention ----

// Tiles: kRowsPerBlock rows per block on the thread side; the other side's
// rows staged kTile at a time: two tiles of kTile × D in at most 32 KiB of
// shared memory.
template <class T, int D>
inline constexpr int kTile = 2 * 32 * D * sizeof(T) <= 32768 ? 32 : 16;

// One thread per query row i of head blockIdx.y: online softmax over key
// tiles. q, k, v rows padded with zeros to D (d <= D).
template <class T, int D>
__global__ void attention_forward_kernel(T* o, T* lse, const T* q, const T* k, const T* v,
                                         AttentionLayout at, int t, int d, T scale,
                                         bool causal) {
  constexpr int Tile = kTile<T, D>;
  __shared__ T ks[Tile][D], vs[Tile][D];
  const int64_t head = blockIdx.x;
  const int row0 = blockIdx.y * kRowsPerBlock;
  const int i = row0 + threadIdx.x;
  const T* qh = q + at.q.at(head, 0, at.heads_per_batch);
  const T* kh = k + at.k.at(head, 0, at.heads_per_batch);
  const T* vh = v + at.v.at(head, 0, at.heads_per_batch);
  T qr[D], acc[D];
#pragma unroll
  for (int c = 0; c < D; ++c) {
    qr[c] = (i < t && c < d) ? qh[i * at.q.row + c] * scale : T(0);
    acc[c] = 0;
  }
  T m = -INFINITY, l = 0;
  const int key_end = causal ? min(t, row0 + kRowsPerBlock) : t;
  for (int j0 = 0; j0 < key_end; j0 += Tile) {
    __syncthreads();
    for (int e = threadIdx.x; e < Tile * D; e += blockDim.x) {
      const int jj = e / D, c = e % D, j = j0 + jj;
      const bool in = j < t && c < d;
      ks[jj][c] = in ? kh[j * at.k.row + c] : T(0);
      vs[jj][c] = in ? vh[j * at.v.row + c] : T(0);
    }
    __syncthreads();
    if (i < t) {
      const int keys = min(Tile, (causal ? i + 1 : t) - j0);
      for (int jj = 0; jj < keys; ++jj) {
        T s = 0;
#pragma unroll
        for (int c = 0; c < D; ++c) s += qr[c] * ks[jj][c];
        const T m_new = fmax(m, s);
        const T correction = exp(m - m_new);
        const T p = exp(s - m_new);
        l = l * correction + p;
#pragma unroll
        for (int c = 0; c < D; ++c) acc[c] = acc[c] * correction + p * vs[jj][c];
        m = m_new;
      }
    }
  }
  if (i < t) {
    const T inv = T(1) / l;
    T* oi = o + at.o.at(head, i, at.heads_per_batch);
    for (int c = 0; c < d; ++c) oi[c] = acc[c] * inv;
    lse[head * t + i] = m + log(l);
  }
}

// One thread per query row: dq_i = scale Σ_j p_ij (do_i·v_j - δ_i) k_j.
template <class T, int D>
__global__ void attention_dq_kernel(T* dq, const T* dout, const T* q, const T* k, const T* v,
                                    const T* lse, const T* delta, AttentionLayout at, int t,
                                    int d, T scale, bool causal) {
  constexpr int Tile = kTile<T, D>;
  __shared__ T ks[Tile][D], vs[Tile][D];
  const int64_t head = blockIdx.x;
  const int row0 = blockIdx.y * kRowsPerBlock;
  const int i = row0 + threadIdx.x;
  const int64_t per = at.heads_per_batch;
  const T* kh = k + at.k.at(head, 0, per);
  const T* vh = v + at.v.at(head, 0, per);
  T qr[D], dor[D], acc[D];
#pragma unroll
  for (int c = 0; c < D; ++c) {
    const bool in = i < t && c < d;
    qr[c] = in ? q[at.q.at(head, i, per) + c] * scale : T(0);
    dor[c] = in ? dout[at.o.at(head, i, per) + c] : T(0);
    acc[c] = 0;
  }
  const T li = i < t ? lse[head * t + i] : T(0);
  const T di = i < t ? delta[head * t + i] : T(0);
  const int key_end = causal ? min(t, row0 + kRowsPerBlock) : t;
  for (int j0 = 0; j0 < key_end; j0 += Tile) {
    __syncthreads();
    for (int e = threadIdx.x; e < Tile * D; e += blockDim.x) {
      const int jj = e / D, c = e % D, j = j0 + jj;
      const bool in = j < t && c < d;
      ks[jj][c] = in ? kh[j * at.k.row + c] : T(0);
      vs[jj][c] = in ? vh[j * at.v.row + c] : T(0);
    }
    __syncthreads();
    if (i < t) {
      const int keys = min(Tile, (causal ? i + 1 : t) - j0);
      for (int jj = 0; jj < keys; ++jj) {
        T s = 0, dp = 0;
#pragma unroll
        for (int c = 0; c < D; ++c) {
          s += qr[c] * ks[jj][c];
          dp += dor[c] * vs[jj][c];
        }
        const T ds = exp(s - li) * (dp - di);
#pragma unroll
        for (int c = 0; c < D; ++c) acc[c] += ds * ks[jj][c];
      }
    }
  }
  if (i < t) {
    T* dqi = dq + at.q.at(head, i, per);
    for (int c = 0; c < d; ++c) dqi[c] = acc[c] * scale;
  }
}

// One thread per key row j: dv_j = Σ_i p_ij do_i, dk_j = scale Σ_i ds_ij q_i
// over the queries that see j, staged a tile at a time.
template <class T, int D>
__global__ void attention_dkdv_kernel(T* dk, T* dv, const T* dout, const T* q, const T* k,
                                      const T* v, const T* lse, const T* delta,
                                      AttentionLayout at, int t, int d, T scale, bool causal) {
  constexpr int Tile = kTile<T, D>;
  __shared__ T qs[Tile][D], dos[Tile][D], ls[Tile], ds_[Tile];
  const int64_t head = blockIdx.x;
  const int row0 = blockIdx.y * kRowsPerBlock;
  const int j = row0 + threadIdx.x;
  const int64_t per = at.heads_per_batch;
  const T* qh = q + at.q.at(head, 0, per);
  const T* doh = dout + at.o.at(head, 0, per);
  T kr[D], vr[D], ak[D], av[D];
#pragma unroll
  for (int c = 0; c < D; ++c) {
    const bool in = j < t && c < d;
    kr[c] = in ? k[at.k.at(head, j, per) + c] * scale : T(0);
    vr[c] = in ? v[at.v.at(head, j, per) + c] : T(0);
    ak[c] = 0;
    av[c] = 0;
  }
  // Causal: queries before this block's first key see none of its keys.
  const int query_begin = causal ? row0 : 0;
  for (int i0 = query_begin; i0 < t; i0 += Tile) {
    __syncthreads();
    for (int e = threadIdx.x; e < Tile * D; e += blockDim.x) {
      const int ii = e / D, c = e % D, i = i0 + ii;
      const bool in = i < t && c < d;
      qs[ii][c] = in ? qh[i * at.q.row + c] : T(0);
      dos[ii][c] = in ? doh[i * at.o.row + c] : T(0);
    }
    for (int ii = threadIdx.x; ii < Tile; ii += blockDim.x) {
      const int i = i0 + ii;
      ls[ii] = i < t ? lse[head * t + i] : T(0);
      ds_[ii] = i < t ? delta[head * t + i] : T(0);
    }
    __syncthreads();
    if (j < t) {
      const int first = causal ? max(0, j - i0) : 0;
      const int last = min(Tile, t - i0);
      for (int ii = first; ii < last; ++ii) {
        T s = 0, dp = 0;
#pragma unroll
        for (int c = 0; c < D; ++c) {
          s += qs[ii][c] * kr[c];
          dp += dos[ii][c] * vr[c];
        }
        const T p = exp(s - ls[ii]);
        const T ds = p * (dp - ds_[ii]);
#pragma unroll
        for (int c = 0; c < D; ++c) {
          av[c] += p * dos[ii][c];
          ak[c] += ds * qs[ii][c];
        }
      }
    }
  }
  if (j < t) {
    T* dkj = dk + at.k.at(head, j, per);
    T* dvj = dv + at.v.at(head, j, per);
    for (int c = 0; c < d; ++c) {
      dkj[c] = ak[c] * scale;
      dvj[c] = av[c];
    }
  }
}

}  // namespace

template <class T>
void layer_norm_forward(Stream s, T* y, T* mean, T* rstd, const T* x, const T* w, const T* b,
                        int64_t rows, int64_t cols, double eps) {
  if (rows == 0) return;
  layer_norm_forward_kernel<T><<<warp_rows_grid(rows), kWarpsPerBlock * 32, 0, as_cuda(s)>>>(
      y, mean, rstd, x, w, b, rows, cols, T(eps));
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void layer_norm_backward(Stream s, T* dx, T* dw, T* db, T* workspace, const T* dy, const T* x,
                         const T* w, const T* mean, const T* rstd, int64_t rows, int64_t cols) {
  if (cols == 0) return;
  cudaStream_t st = as_cuda(s);
  if (rows > 0) {
    layer_norm_dx_kernel<T><<<warp_rows_grid(rows), kWarpsPerBlock * 32, 0, st>>>(
        dx, dy, x, w, mean, rstd, rows, cols);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  }
  const int64_t chunks = layer_norm_row_chunks(rows);
  dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(chunks));
  layer_norm_dwdb_partial_kernel<T><<<grid, 256, 0, st>>>(workspace, dy, x, mean, rstd, rows,
                                                          cols, chunks);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  layer_norm_dwdb_final_kernel<T><<<grid.x, 256, 0, st>>>(dw, db, workspace, cols, chunks);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void attention_forward(Stream s, T* o, T* lse, const T* q, const T* k, const T* v,
                       const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,
                       double scale, bool causal) {
  if (heads * t == 0) return;
  with_head_size(d, [&](auto size) {
    constexpr int D = decltype(size)::value;
    attention_forward_kernel<T, D><<<attention_grid(heads, t), kRowsPerBlock, 0, as_cuda(s)>>>(
        o, lse, q, k, v, at, static_cast<int>(t), static_cast<int>(d), T(scale), causal);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  });
}

template <class T>
void attention_backward(Stream s, T* dq, T* dk, T* dv, T* workspace, const T* dout, const T* q,
                        const T* k, const T* v, const T* o, const T* lse,
                        const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,
                        double scale, bool causal) {
  if (heads * t == 0) return;
  cudaStream_t st = as_cuda(s);
  T* delta = workspace;
  launch_attention_delta<T>(delta, dout, o, at, heads, t, d, st);
  with_head_size(d, [&](auto size) {
    constexpr int D = decltype(size)::value;
    const dim3 grid = attention_grid(heads, t);
    attention_dq_kernel<T, D><<<grid, kRowsPerBlock, 0, st>>>(
        dq, dout, q, k, v, lse, delta, at, static_cast<int>(t), static_cast<int>(d), T(scale),
        causal);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    attention_dkdv_kernel<T, D><<<grid, kRowsPerBlock, 0, st>>>(
        dk, dv, dout, q, k, v, lse, delta, at, static_cast<int>(t), static_cast<int>(d),
        T(scale), causal);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  });
}

LEASEHOLD_TRANSFORMER_INSTANCES(float)
LEASEHOLD_TRANSFORMER_INSTANCES(double)

}  // namespace leasehold::kernels::cuda
