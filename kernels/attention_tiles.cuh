// The pieces the tensor-core attention kernels (attention_bf16.cu) are built
// from: mma.sync m16n8k16 products on bfloat16 fragments with float32
// accumulators, the fragments' loads from registers, global and shared
// memory (ldmatrix.trans for a product that runs along a tile's rows), and
// tiles staged in shared memory as bfloat16 (cp.async for bfloat16 rows of
// whole 16-byte words, rounded by the threads for float32 ones). Device
// code only, included by that one file.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace leasehold::kernels::cuda::attention_tiles {

using bf16 = __nv_bfloat16;

// Rows of the other side staged per step: register and shared-memory use
// grow with the head size D.
template <int D>
inline constexpr int kCols = D <= 64 ? 64 : 32;
// Row strides in shared memory, in bfloat16: 8 more than the row (16 bytes)
// puts the 8 rows an mma fragment load touches in different banks.
template <int N>
inline constexpr int kPadded = N + 8;

// An activation element as float32, and back (rounded to nearest even).
__device__ inline float to_float(float x) { return x; }
__device__ inline float to_float(bf16 x) { return __bfloat162float(x); }
template <class E>
__device__ inline E from_float(float x);
template <>
__device__ inline float from_float<float>(float x) {
  return x;
}
template <>
__device__ inline bf16 from_float<bf16>(float x) {
  return __float2bfloat16_rn(x);
}

// Two bfloat16 in one register, the lower index in the low half.
__device__ inline uint32_t pack(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// c[16×8] += a[16×16] · b[16×8]. Fragments (lane = 4 g + q):
//   a: {rows g, g+8} × {cols 2q, 2q+1}, then the same at cols + 8
//   b: rows {2q, 2q+1} of col g, then rows + 8
//   c: rows g (c0, c1) and g + 8 (c2, c3), cols 2q, 2q+1
__device__ inline void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The B fragment of columns n0..n0+7 and rows k0..k0+15 of a matrix kept
// as rows of its columns: src[n * ld + k] is element (k, n).
__device__ inline void load_b(uint32_t& b0, uint32_t& b1, const bf16* src, int ld, int n0, int k0) {
  const int lane = threadIdx.x % 32;
  const bf16* p = src + (n0 + lane / 4) * ld + k0 + 2 * (lane % 4);
  b0 = *reinterpret_cast<const uint32_t*>(p);
  b1 = *reinterpret_cast<const uint32_t*>(p + 8);
}

// The same fragment from a matrix kept row-major: src[k * ld + n] is element
// (k, n), and ldmatrix.trans hands each lane its two elements of column
// n0 + lane / 4 (lanes 0-7 address rows k0..k0+7 for b0, lanes 8-15 the
// next 8 for b1; rows 16-byte aligned, which the padded strides keep).
__device__ inline void load_b_trans(uint32_t& b0, uint32_t& b1, const bf16* src, int ld, int n0,
                                    int k0) {
  const int lane = threadIdx.x % 32;
  const bf16* p = src + (k0 + lane % 16) * ld + n0;
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(b0), "=r"(b1)
               : "r"(addr));
}

// A fragments of this warp's 16 rows (row0 + [0, 16)) of a [t, d] matrix
// with rows `ld` apart, over D columns, times `mul`, rounded to bfloat16;
// zeros past t and d.
template <int D, class E>
__device__ inline void load_a_rows(uint32_t (&f)[D / 16][4], const E* src, int64_t ld, int row0,
                                   int t, int d, float mul) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = row0 + lane / 4 + 8 * (r % 2);
      const int col = kk * 16 + 8 * (r / 2) + 2 * (lane % 4);
      const E* p = src + row * ld + col;
      const float x0 = row < t && col < d ? to_float(p[0]) * mul : 0.f;
      const float x1 = row < t && col + 1 < d ? to_float(p[1]) * mul : 0.f;
      f[kk][r] = pack(x0, x1);
    }
  }
}

// The A fragment of keys (or queries) 16 kk .. 16 kk + 15 from the float32
// accumulators of two 16×8 products over them: probabilities to bfloat16.
__device__ inline void accumulators_as_a(uint32_t (&a)[4], const float (&lo)[4],
                                         const float (&hi)[4]) {
  a[0] = pack(lo[0], lo[1]);
  a[1] = pack(lo[2], lo[3]);
  a[2] = pack(hi[0], hi[1]);
  a[3] = pack(hi[2], hi[3]);
}

// 16 bytes from global to shared memory without passing through registers,
// or 16 zero bytes when !fill (cp.async's source size 0; src must still be
// a valid address). Complete once a later cp_async_wait covers its group.
__device__ inline void cp_async16(void* dst, const void* src, bool fill) {
  const auto to = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(to), "l"(src),
               "r"(fill ? 16 : 0));
}
__device__ inline void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ inline void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Rows r0 .. r0 + R - 1 of a [t, d] matrix with rows `lds` apart into
// shared memory as bfloat16 (row stride ld), zeros past t and d. Rows that
// start 16-byte aligned with whole 16-byte words move a word at a time:
// float32 rounded four at a time, bfloat16 copied eight at a time by
// cp.async (in flight until the caller waits for it).
template <int R, int D, class E>
__device__ inline void stage(bf16* rows, int ld, const E* src, int64_t lds, int r0, int t, int d) {
  constexpr int kWord = 16 / sizeof(E);
  if (d % kWord == 0 && lds % kWord == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    for (int e = kWord * threadIdx.x; e < R * D; e += kWord * blockDim.x) {
      const int r = e / D, c = e % D, row = r0 + r;
      const bool in = row < t && c < d;
      if constexpr (sizeof(E) == 4) {
        const float4 x = in ? *reinterpret_cast<const float4*>(src + row * lds + c)
                            : make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<uint2*>(rows + r * ld + c) = {pack(x.x, x.y), pack(x.z, x.w)};
      } else {
        cp_async16(rows + r * ld + c, in ? src + row * lds + c : src, in);
      }
    }
    return;
  }
  for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
    const int r = e / D, c = e % D, row = r0 + r;
    rows[r * ld + c] = __float2bfloat16_rn(row < t && c < d ? to_float(src[row * lds + c]) : 0.f);
  }
}

// Writes this warp's 16 rows (row0 + ...) of a [t, d] result with rows `ld`
// apart from accumulators over D columns, times `mul_lo` (rows row0 +
// lane / 4) and `mul_hi` (8 further).
template <int D, class E>
__device__ inline void store_rows(E* dst, int64_t ld, const float (&acc)[D / 8][4], int row0,
                                  int t, int d, float mul_lo, float mul_hi) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = row0 + lane / 4 + 8 * h, col = nd * 8 + 2 * (lane % 4);
      if (row >= t) continue;
      const float mul = h ? mul_hi : mul_lo;
      E* p = dst + row * ld + col;
      if (col < d) p[0] = from_float<E>(acc[nd][2 * h] * mul);
      if (col + 1 < d) p[1] = from_float<E>(acc[nd][2 * h + 1] * mul);
    }
  }
}

}  // namespace leasehold::kernels::cuda::attention_tiles
