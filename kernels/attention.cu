// CUDA attention kernels on float32 and float64 tensors: the FlashAttention
// algorithm, one thread per query (forward, dq) or key (dk, dv) row, tiles
// of the other side staged in shared memory, an online softmax; the [t, t]
// scores are never stored. (Under autocast attention runs on tensor cores
// instead: attention_bf16.cu.)
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "kernels/attention_launch.cuh"
#include "kernels/launch.cuh"
#include "kernels/transformer.h"

namespace leasehold::kernels::cuda {
namespace {

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

LEASEHOLD_ATTENTION_INSTANCES(float)
LEASEHOLD_ATTENTION_INSTANCES(double)

}  // namespace leasehold::kernels::cuda
