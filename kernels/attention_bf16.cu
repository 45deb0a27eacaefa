// Attention on tensor cores under autocast, for float32 or bfloat16
// activations (the element type E below): the FlashAttention-2 scheme with
// bfloat16 mma.sync products (m16n8k16, float32 accumulation; the pieces in
// attention_tiles.cuh). A block takes 64 rows of one head, 16 per warp; the
// warp's own rows (queries, or keys in dK/dV) stay in registers as mma A
// fragments, read straight from global memory, and the other side is
// staged 64 (32 for head sizes over 64) rows at a time in shared memory as
// bfloat16, row-major, in two buffers: bfloat16 activations copy the next
// tile in with cp.async while the products run on this one (float32 ones
// are loaded and rounded by the threads themselves, into the other buffer,
// before the products: no overlap). Scores and probabilities never leave
// registers: a product's float32 accumulators are the next product's
// bfloat16 A fragment. The softmax runs in base 2 on float32 statistics.
// No atomics: dQ has a kernel of its own, so every gradient is summed in a
// fixed order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/attention_launch.cuh"
#include "kernels/attention_tiles.cuh"
#include "kernels/bfloat16.h"
#include "kernels/launch.cuh"
#include "kernels/transformer.h"

namespace leasehold::kernels::cuda {
namespace {

using namespace attention_tiles;

constexpr int kWarps = 4;  // 16 rows each: kRowsPerBlock
static_assert(kWarps * 16 == kRowsPerBlock);
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---- forward ----

template <int D, class E>
__global__ void __launch_bounds__(kWarps * 32)
    attention_forward_bf16_kernel(E* o, float* lse, const E* q, const E* k, const E* v,
                                  AttentionLayout at, int t, int d, float scale_log2,
                                  bool causal) {
  constexpr int C = kCols<D>, LD = kPadded<D>;
  __shared__ __align__(16) bf16 ks[2][C * LD];  // keys, this tile's and the next's
  __shared__ __align__(16) bf16 vs[2][C * LD];  // values
  const int64_t head = blockIdx.x, per = at.heads_per_batch;
  const E* qh = q + at.q.at(head, 0, per);
  const E* kh = k + at.k.at(head, 0, per);
  const E* vh = v + at.v.at(head, 0, per);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int block_row0 = blockIdx.y * kRowsPerBlock, row0 = block_row0 + 16 * warp;
  const int row[2] = {row0 + lane / 4, row0 + lane / 4 + 8};

  uint32_t qf[D / 16][4];
  load_a_rows<D>(qf, qh, at.q.row, row0, t, d, 1.f);
  float acc[D / 8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  const int key_end = causal ? min(t, block_row0 + kRowsPerBlock) : t;
  stage<C, D>(ks[0], LD, kh, at.k.row, 0, t, d);
  stage<C, D>(vs[0], LD, vh, at.v.row, 0, t, d);
  cp_async_commit();
  for (int j0 = 0, buf = 0; j0 < key_end; j0 += C, buf ^= 1) {
    // This tile has landed and every warp is done with the other buffer:
    // the next tile goes there while this one is multiplied.
    cp_async_wait_all();
    __syncthreads();
    if (j0 + C < key_end) {
      stage<C, D>(ks[buf ^ 1], LD, kh, at.k.row, j0 + C, t, d);
      stage<C, D>(vs[buf ^ 1], LD, vh, at.v.row, j0 + C, t, d);
    }
    cp_async_commit();
    // s = q kᵀ over this tile's keys.
    float s[C / 8][4] = {};
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t b0, b1;
        load_b(b0, b1, ks[buf], LD, nt * 8, kk * 16);
        mma(s[nt], qf[kk], b0, b1);
      }
    }
    // Online softmax in base 2; masked keys score -inf.
    float mx[2] = {m[0], m[1]};
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j0 + nt * 8 + 2 * (lane % 4) + e % 2;
        const bool seen = key < t && !(causal && key > row[e / 2]);
        s[nt][e] = seen ? s[nt][e] * scale_log2 : -INFINITY;
        mx[e / 2] = fmaxf(mx[e / 2], s[nt][e]);
      }
    }
    float shift[2], correction[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
      mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
      shift[h] = mx[h] == -INFINITY ? 0.f : mx[h];  // a row that has seen no key yet
      correction[h] = exp2f(m[h] - shift[h]);
      m[h] = mx[h];
      l[h] *= correction[h];
    }
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = exp2f(s[nt][e] - shift[e / 2]);
        l[e / 2] += s[nt][e];  // this lane's columns; summed over the row at the end
      }
    }
#pragma unroll
    for (int nd = 0; nd < D / 8; ++nd) {
      acc[nd][0] *= correction[0];
      acc[nd][1] *= correction[0];
      acc[nd][2] *= correction[1];
      acc[nd][3] *= correction[1];
    }
    // acc += p v.
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {
      uint32_t a[4];
      accumulators_as_a(a, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        uint32_t b0, b1;
        load_b_trans(b0, b1, vs[buf], LD, nd * 8, kk * 16);
        mma(acc[nd], a, b0, b1);
      }
    }
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
  }
  store_rows<D>(o + at.o.at(head, 0, per), at.o.row, acc, row0, t, d, 1.f / l[0], 1.f / l[1]);
  if (lane % 4 == 0) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (row[h] < t) lse[head * t + row[h]] = (m[h] + log2f(l[h])) * kLn2;
    }
  }
}

// ---- backward ----

// p and ds of one score (query row `qrow`, key `key`) from s = q·k and
// dp = do·v: p = exp(s · scale - lse), ds = p (dp - delta); both 0 where the
// query does not see the key.
__device__ inline void probability_and_gradient(float& s, float& dp, int qrow, int key, int t,
                                                bool causal, float scale_log2, float lse2,
                                                float delta) {
  const bool seen = qrow < t && key < t && !(causal && key > qrow);
  const float p = seen ? exp2f(s * scale_log2 - lse2) : 0.f;
  s = p;
  dp = p * (dp - delta);
}

// dq for 64 queries per block: dq = scale · Σ over keys of ds k.
template <int D, class E>
__global__ void __launch_bounds__(kWarps * 32)
    attention_dq_bf16_kernel(E* dq, const E* dout, const E* q, const E* k, const E* v,
                             const float* lse, const float* delta, AttentionLayout at, int t,
                             int d, float scale, bool causal) {
  constexpr int C = kCols<D>, LD = kPadded<D>;
  __shared__ __align__(16) bf16 ks[2][C * LD];  // keys, this tile's and the next's
  __shared__ __align__(16) bf16 vs[2][C * LD];  // values
  const int64_t head = blockIdx.x, per = at.heads_per_batch;
  const int64_t qb = at.q.at(head, 0, per), kb = at.k.at(head, 0, per),
                vb = at.v.at(head, 0, per), ob = at.o.at(head, 0, per);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int block_row0 = blockIdx.y * kRowsPerBlock, row0 = block_row0 + 16 * warp;
  const int row[2] = {row0 + lane / 4, row0 + lane / 4 + 8};
  const float scale_log2 = scale * kLog2e;

  uint32_t qf[D / 16][4], df[D / 16][4];
  load_a_rows<D>(qf, q + qb, at.q.row, row0, t, d, 1.f);
  load_a_rows<D>(df, dout + ob, at.o.row, row0, t, d, 1.f);
  float lse2[2], dl[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    lse2[h] = row[h] < t ? lse[head * t + row[h]] * kLog2e : 0.f;
    dl[h] = row[h] < t ? delta[head * t + row[h]] : 0.f;
  }
  float acc[D / 8][4] = {};

  const int key_end = causal ? min(t, block_row0 + kRowsPerBlock) : t;
  stage<C, D>(ks[0], LD, k + kb, at.k.row, 0, t, d);
  stage<C, D>(vs[0], LD, v + vb, at.v.row, 0, t, d);
  cp_async_commit();
  for (int j0 = 0, buf = 0; j0 < key_end; j0 += C, buf ^= 1) {
    cp_async_wait_all();
    __syncthreads();
    if (j0 + C < key_end) {
      stage<C, D>(ks[buf ^ 1], LD, k + kb, at.k.row, j0 + C, t, d);
      stage<C, D>(vs[buf ^ 1], LD, v + vb, at.v.row, j0 + C, t, d);
    }
    cp_async_commit();
    float s[C / 8][4] = {}, dp[C / 8][4] = {};
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t b0, b1;
        load_b(b0, b1, ks[buf], LD, nt * 8, kk * 16);
        mma(s[nt], qf[kk], b0, b1);
        load_b(b0, b1, vs[buf], LD, nt * 8, kk * 16);
        mma(dp[nt], df[kk], b0, b1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int key = j0 + nt * 8 + 2 * (lane % 4) + e % 2;
        probability_and_gradient(s[nt][e], dp[nt][e], row[e / 2], key, t, causal, scale_log2,
                                 lse2[e / 2], dl[e / 2]);
      }
    }
    // acc += ds k.
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {
      uint32_t a[4];
      accumulators_as_a(a, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        uint32_t b0, b1;
        load_b_trans(b0, b1, ks[buf], LD, nd * 8, kk * 16);
        mma(acc[nd], a, b0, b1);
      }
    }
  }
  store_rows<D>(dq + qb, at.q.row, acc, row0, t, d, scale, scale);
}

// dk and dv for 64 keys per block: dv = Σ over queries of p do, dk = scale ·
// Σ ds q, from sᵀ = k qᵀ and dpᵀ = v doᵀ.
template <int D, class E>
__global__ void __launch_bounds__(kWarps * 32)
    attention_dkdv_bf16_kernel(E* dk, E* dv, const E* dout, const E* q, const E* k, const E* v,
                               const float* lse, const float* delta, AttentionLayout at, int t,
                               int d, float scale, bool causal) {
  constexpr int C = kCols<D>, LD = kPadded<D>;
  __shared__ __align__(16) bf16 qs[2][C * LD];  // queries, this tile's and the next's
  __shared__ __align__(16) bf16 ds[2][C * LD];  // output gradients
  __shared__ float lse2s[2][C], deltas[2][C];
  const int64_t head = blockIdx.x, per = at.heads_per_batch;
  const int64_t qb = at.q.at(head, 0, per), kb = at.k.at(head, 0, per),
                vb = at.v.at(head, 0, per), ob = at.o.at(head, 0, per);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int block_key0 = blockIdx.y * kRowsPerBlock, key0 = block_key0 + 16 * warp;
  const int key[2] = {key0 + lane / 4, key0 + lane / 4 + 8};
  const float scale_log2 = scale * kLog2e;

  uint32_t kf[D / 16][4], vf[D / 16][4];
  load_a_rows<D>(kf, k + kb, at.k.row, key0, t, d, 1.f);
  load_a_rows<D>(vf, v + vb, at.v.row, key0, t, d, 1.f);
  float dk_acc[D / 8][4] = {}, dv_acc[D / 8][4] = {};

  // Causal: queries before this block's first key see none of its keys.
  const int query_begin = causal ? block_key0 / C * C : 0;
  // A tile of queries, their output gradients and their statistics.
  auto stage_queries = [&](int b, int i0) {
    stage<C, D>(qs[b], LD, q + qb, at.q.row, i0, t, d);
    stage<C, D>(ds[b], LD, dout + ob, at.o.row, i0, t, d);
    for (int i = threadIdx.x; i < C; i += blockDim.x) {
      const bool in = i0 + i < t;
      lse2s[b][i] = in ? lse[head * t + i0 + i] * kLog2e : 0.f;
      deltas[b][i] = in ? delta[head * t + i0 + i] : 0.f;
    }
  };
  if (query_begin < t) stage_queries(0, query_begin);
  cp_async_commit();
  for (int i0 = query_begin, buf = 0; i0 < t; i0 += C, buf ^= 1) {
    cp_async_wait_all();
    __syncthreads();
    if (i0 + C < t) stage_queries(buf ^ 1, i0 + C);
    cp_async_commit();
    // sᵀ = k qᵀ and dpᵀ = v doᵀ over this tile's queries.
    float s[C / 8][4] = {}, dp[C / 8][4] = {};
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt) {
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        uint32_t b0, b1;
        load_b(b0, b1, qs[buf], LD, nt * 8, kk * 16);
        mma(s[nt], kf[kk], b0, b1);
        load_b(b0, b1, ds[buf], LD, nt * 8, kk * 16);
        mma(dp[nt], vf[kk], b0, b1);
      }
    }
#pragma unroll
    for (int nt = 0; nt < C / 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * (lane % 4) + e % 2;
        probability_and_gradient(s[nt][e], dp[nt][e], i0 + col, key[e / 2], t, causal,
                                 scale_log2, lse2s[buf][col], deltas[buf][col]);
      }
    }
    // dv += pᵀ do, dk += dsᵀ q.
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {
      uint32_t ap[4], ad[4];
      accumulators_as_a(ap, s[2 * kk], s[2 * kk + 1]);
      accumulators_as_a(ad, dp[2 * kk], dp[2 * kk + 1]);
#pragma unroll
      for (int nd = 0; nd < D / 8; ++nd) {
        uint32_t b0, b1;
        load_b_trans(b0, b1, ds[buf], LD, nd * 8, kk * 16);
        mma(dv_acc[nd], ap, b0, b1);
        load_b_trans(b0, b1, qs[buf], LD, nd * 8, kk * 16);
        mma(dk_acc[nd], ad, b0, b1);
      }
    }
  }
  store_rows<D>(dk + kb, at.k.row, dk_acc, key0, t, d, scale, scale);
  store_rows<D>(dv + vb, at.v.row, dv_acc, key0, t, d, 1.f, 1.f);
}

// backward's row dot products (delta = do · o per row, float32) for
// bfloat16 rows that start 16-byte aligned: G lanes a row, 8 elements a
// lane a load, 32 / G rows a warp (the generic kernel's warp a row reads
// two bytes a lane). Each row's sum in a fixed order.
template <int G>
__global__ void attention_delta_bf16_kernel(float* delta, const bf16* dout, const bf16* o,
                                            AttentionLayout at, int64_t rows, int64_t t, int d) {
  const int lane = threadIdx.x % 32, sub = lane % G;
  constexpr int kRowsPerWarp = 32 / G;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t base = (blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32) * kRowsPerWarp;
       base < rows; base += warps * kRowsPerWarp) {
    const int64_t r = base + lane / G;
    float s = 0.f;
    if (r < rows) {
      const int64_t at_row = at.o.at(r / t, r % t, at.heads_per_batch);
      for (int c = sub * 8; c < d; c += G * 8) {
        const uint4 a = *reinterpret_cast<const uint4*>(dout + at_row + c);
        const uint4 b = *reinterpret_cast<const uint4*>(o + at_row + c);
        const bf16* pa = reinterpret_cast<const bf16*>(&a);
        const bf16* pb = reinterpret_cast<const bf16*>(&b);
#pragma unroll
        for (int j = 0; j < 8; ++j) s += to_float(pa[j]) * to_float(pb[j]);
      }
    }
#pragma unroll
    for (int off = G / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (sub == 0 && r < rows) delta[r] = s;
  }
}

// delta through attention_delta_bf16_kernel where the rows allow it; false
// (nothing launched) otherwise.
bool launch_delta_bf16(float* delta, const bf16* dout, const bf16* o, const AttentionLayout& at,
                       int64_t heads, int64_t t, int64_t d, cudaStream_t st) {
  const HeadRows& r = at.o;
  const bool aligned = reinterpret_cast<uintptr_t>(dout) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(o) % 16 == 0 && r.batch % 8 == 0 &&
                       r.head % 8 == 0 && r.row % 8 == 0;
  if (!aligned || d % 8 != 0 || d > 256) return false;
  const int64_t rows = heads * t;
  auto go = [&](auto g) {
    constexpr int G = decltype(g)::value;
    constexpr int kWarps = 8;
    const int64_t per_block = kWarps * (32 / G);
    const auto blocks =
        static_cast<unsigned>(std::clamp<int64_t>((rows + per_block - 1) / per_block, 1, 65535));
    attention_delta_bf16_kernel<G><<<blocks, kWarps * 32, 0, st>>>(delta, dout, o, at, rows, t,
                                                                  static_cast<int>(d));
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  };
  const int64_t lanes = d / 8;  // 1 .. 32
  if (lanes <= 1) {
    go(std::integral_constant<int, 1>{});
  } else if (lanes <= 2) {
    go(std::integral_constant<int, 2>{});
  } else if (lanes <= 4) {
    go(std::integral_constant<int, 4>{});
  } else if (lanes <= 8) {
    go(std::integral_constant<int, 8>{});
  } else if (lanes <= 16) {
    go(std::integral_constant<int, 16>{});
  } else {
    go(std::integral_constant<int, 32>{});
  }
  return true;
}

// The device element type behind a host one.
template <class T>
using Device = std::conditional_t<std::is_same_v<T, bfloat16>, bf16, T>;
template <class T>
auto dev(T* p) {
  return reinterpret_cast<Device<std::remove_const_t<T>>*>(p);
}
template <class T>
auto dev(const T* p) {
  return reinterpret_cast<const Device<T>*>(p);
}

}  // namespace

template <class T>
void attention_forward_bf16(Stream s, T* o, float* lse, const T* q, const T* k, const T* v,
                            const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,
                            double scale, bool causal) {
  if (heads * t == 0) return;
  with_head_size(d, [&](auto size) {
    constexpr int D = decltype(size)::value;
    attention_forward_bf16_kernel<D, Device<T>>
        <<<attention_grid(heads, t), kWarps * 32, 0, as_cuda(s)>>>(
            dev(o), lse, dev(q), dev(k), dev(v), at, static_cast<int>(t), static_cast<int>(d),
            static_cast<float>(scale) * kLog2e, causal);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  });
}

template <class T>
void attention_backward_bf16(Stream s, T* dq, T* dk, T* dv, float* workspace, const T* dout,
                             const T* q, const T* k, const T* v, const T* o, const float* lse,
                             const AttentionLayout& at, int64_t heads, int64_t t, int64_t d,
                             double scale, bool causal) {
  if (heads * t == 0) return;
  cudaStream_t st = as_cuda(s);
  float* delta = workspace;
  bool delta_done = false;
  if constexpr (std::is_same_v<T, bfloat16>) {
    delta_done = launch_delta_bf16(delta, dev(dout), dev(o), at, heads, t, d, st);
  }
  if (!delta_done) {
    launch_attention_delta<Device<T>, float>(delta, dev(dout), dev(o), at, heads, t, d, st);
  }
  with_head_size(d, [&](auto size) {
    constexpr int D = decltype(size)::value;
    const dim3 grid = attention_grid(heads, t);
    attention_dq_bf16_kernel<D, Device<T>><<<grid, kWarps * 32, 0, st>>>(
        dev(dq), dev(dout), dev(q), dev(k), dev(v), lse, delta, at, static_cast<int>(t),
        static_cast<int>(d), static_cast<float>(scale), causal);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    attention_dkdv_bf16_kernel<D, Device<T>><<<grid, kWarps * 32, 0, st>>>(
        dev(dk), dev(dv), dev(dout), dev(q), dev(k), dev(v), lse, delta, at,
        static_cast<int>(t), static_cast<int>(d), static_cast<float>(scale), causal);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  });
}

#define LEASEHOLD_ATTENTION_BF16_OF(T)                                                        \
  template void attention_forward_bf16<T>(Stream, T*, float*, const T*, const T*, const T*,  \
                                          const AttentionLayout&, int64_t, int64_t, int64_t, \
                                          double, bool);                                     \
  template void attention_backward_bf16<T>(Stream, T*, T*, T*, float*, const T*, const T*,   \
                                           const T*, const T*, const T*, const float*,       \
                                           const AttentionLayout&, int64_t, int64_t,         \
                                           int64_t, double, bool);
LEASEHOLD_ATTENTION_BF16_OF(float)
LEASEHOLD_ATTENTION_BF16_OF(bfloat16)
#undef LEASEHOLD_ATTENTION_BF16_OF

}  // namespace leasehold::kernels::cuda
