// CUDA layer norm kernels: a warp per row, the statistics and every sum in
// float32 or the tensors' own float64; backward's weight and bias
// gradients summed over chunks of rows in a fixed order (the same bits
// every run). Under autocast y and dy may be bfloat16.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "kernels/block_reduce.cuh"
#include "kernels/launch.cuh"
#include "kernels/sum_parts.cuh"
#include "kernels/transformer.h"

namespace leasehold::kernels::cuda {
namespace {

constexpr int kWarpsPerBlock = 8;

unsigned warp_rows_grid(int64_t rows) {
  return static_cast<unsigned>(
      std::clamp<int64_t>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock, 1, 65535));
}

// The scalar kernels take any width and float or double; Y is the output's
// type and G the gradient's (bfloat16 under autocast, for a y that only a
// product reads), read and written through T.
template <class T, class Y>
__global__ void layer_norm_forward_kernel(Y* y, T* mean, T* rstd, const T* x, const T* w,
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
    for (int64_t c = lane; c < cols; c += 32) {
      y[r * cols + c] = Y((xr[c] - mu) * rs * w[c] + b[c]);
    }
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// a + b rounded once, never fused with the product that made a (the sum
// the engine would make after the kernel, bit for bit).
__device__ inline float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ inline double add_rn(double a, double b) { return __dadd_rn(a, b); }

template <class T, class G>
__global__ void layer_norm_dx_kernel(T* dx, const T* dx_plus, const G* dy, const T* x,
                                     const T* w, const T* mean, const T* rstd, int64_t rows,
                                     int64_t cols) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; r < rows;
       r += int64_t(gridDim.x) * kWarpsPerBlock) {
    const T* xr = x + r * cols;
    const G* gr = dy + r * cols;
    const T mu = mean[r], rs = rstd[r];
    T a = 0, bsum = 0;
    for (int64_t c = lane; c < cols; c += 32) {
      const T gw = T(gr[c]) * w[c];
      a += gw;
      bsum += gw * (xr[c] - mu) * rs;
    }
    a = warp_sum(a) / T(cols);
    bsum = warp_sum(bsum) / T(cols);
    for (int64_t c = lane; c < cols; c += 32) {
      const T own = rs * (T(gr[c]) * w[c] - a - (xr[c] - mu) * rs * bsum);
      dx[r * cols + c] = dx_plus ? add_rn(own, dx_plus[r * cols + c]) : own;
    }
  }
}

// The scalar dw/db kernel's blocks: 32 columns × 8 lanes. Each thread's (w, b)
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
template <class T, class G>
__global__ void layer_norm_dwdb_partial_kernel(T* partial, const G* dy, const T* x,
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
      const T g = T(dy[r * cols + col]);
      aw += g * (x[r * cols + col] - mean[r]) * rstd[r];
      ab += g;
    }
  }
  if (sum_lanes(aw, ab) && col < cols) {
    partial[chunk * cols + col] = aw;
    partial[(chunks + chunk) * cols + col] = ab;
  }
}

// The float32 kernels for rows of a multiple of 4 up to kRowWidthMax
// columns: a warp holds its row in registers, 4 columns a lane per step of
// 128 (V steps), so x is read once with 16-byte loads. Backward also sums
// dw and db over its chunk of rows in registers, then across its warps in
// a fixed order, instead of reading dy and x again.
constexpr int64_t kRowWidthMax = 1024;

struct alignas(8) Bf16x4 {
  bfloat16 v[4];
};
__device__ inline float4 load4(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ inline float4 load4(const bfloat16* p) {
  const Bf16x4 b = *reinterpret_cast<const Bf16x4*>(p);
  return make_float4(float(b.v[0]), float(b.v[1]), float(b.v[2]), float(b.v[3]));
}
__device__ inline void store4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ inline void store4(bfloat16* p, float4 v) {
  Bf16x4 b;
  b.v[0] = bfloat16(v.x);
  b.v[1] = bfloat16(v.y);
  b.v[2] = bfloat16(v.z);
  b.v[3] = bfloat16(v.w);
  *reinterpret_cast<Bf16x4*>(p) = b;
}
__device__ inline float4 zero4() { return make_float4(0.f, 0.f, 0.f, 0.f); }

template <class Y, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_forward_rows_kernel(Y* y, float* mean, float* rstd, const float* x,
                                   const float* w, const float* b, int64_t rows, int cols,
                                   float eps) {
  const int lane = threadIdx.x % 32;
  for (int64_t r = blockIdx.x * int64_t(kWarpsPerBlock) + threadIdx.x / 32; r < rows;
       r += int64_t(gridDim.x) * kWarpsPerBlock) {
    const float* xr = x + r * cols;
    // (w and b loaded with x: each load after the row's sums would be
    // another trip to memory before the row can be written.)
    float4 v[V], wv[V], bv[V];
    float sum = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = (i * 32 + lane) * 4;
      const bool in = c < cols;
      v[i] = in ? load4(xr + c) : zero4();
      wv[i] = in ? load4(w + c) : zero4();
      bv[i] = in ? load4(b + c) : zero4();
      sum += (v[i].x + v[i].y) + (v[i].z + v[i].w);
    }
    const float mu = warp_sum(sum) / float(cols);
    float sq = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      if ((i * 32 + lane) * 4 < cols) {
        const float4 d = make_float4(v[i].x - mu, v[i].y - mu, v[i].z - mu, v[i].w - mu);
        sq += (d.x * d.x + d.y * d.y) + (d.z * d.z + d.w * d.w);
      }
    }
    const float rs = 1.0f / sqrtf(warp_sum(sq) / float(cols) + eps);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = (i * 32 + lane) * 4;
      if (c < cols) {
        store4(y + r * cols + c, make_float4((v[i].x - mu) * rs * wv[i].x + bv[i].x,
                                             (v[i].y - mu) * rs * wv[i].y + bv[i].y,
                                             (v[i].z - mu) * rs * wv[i].z + bv[i].z,
                                             (v[i].w - mu) * rs * wv[i].w + bv[i].w));
      }
    }
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// One block per chunk of rows (layer_norm_row_chunks), warp j taking rows
// begin + j, begin + j + 8, ...: dx for each row, and partial[chunk][col]
// (dw then db halves) summed in the scalar kernels' order (their roundings
// of each term differ). Dynamic shared memory: 2 × cols floats.
template <class G, int V>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    layer_norm_backward_rows_kernel(float* dx, const float* dx_plus, float* partial, const G* dy,
                                    const float* x, const float* w, const float* mean,
                                    const float* rstd, int64_t rows, int cols, int64_t chunks) {
  extern __shared__ float sums[];  // dw [cols], then db [cols]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t chunk = blockIdx.x;
  const int64_t per = (rows + chunks - 1) / chunks;
  const int64_t begin = chunk * per, end = min(rows, begin + per);
  float4 wv[V], aw[V], ab[V];
#pragma unroll
  for (int i = 0; i < V; ++i) {
    const int c = (i * 32 + lane) * 4;
    wv[i] = c < cols ? load4(w + c) : zero4();
    aw[i] = ab[i] = zero4();
  }
  for (int64_t r = begin + warp; r < end; r += kWarpsPerBlock) {
    float4 xh[V], gw[V], plus[V];  // x̂, dy · w, and dx_plus (loaded with x and dy)
    const float mu = mean[r], rs = rstd[r];
    float a = 0, bsum = 0;
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = (i * 32 + lane) * 4;
      if (c < cols) {
        const float4 xv = load4(x + r * cols + c), g = load4(dy + r * cols + c);
        plus[i] = dx_plus ? load4(dx_plus + r * cols + c) : zero4();
        xh[i] = make_float4((xv.x - mu) * rs, (xv.y - mu) * rs, (xv.z - mu) * rs,
                            (xv.w - mu) * rs);
        gw[i] = make_float4(g.x * wv[i].x, g.y * wv[i].y, g.z * wv[i].z, g.w * wv[i].w);
        a += (gw[i].x + gw[i].y) + (gw[i].z + gw[i].w);
        bsum += (gw[i].x * xh[i].x + gw[i].y * xh[i].y) + (gw[i].z * xh[i].z + gw[i].w * xh[i].w);
        aw[i].x += g.x * xh[i].x;
        aw[i].y += g.y * xh[i].y;
        aw[i].z += g.z * xh[i].z;
        aw[i].w += g.w * xh[i].w;
        ab[i].x += g.x;
        ab[i].y += g.y;
        ab[i].z += g.z;
        ab[i].w += g.w;
      }
    }
    a = warp_sum(a) / float(cols);
    bsum = warp_sum(bsum) / float(cols);
#pragma unroll
    for (int i = 0; i < V; ++i) {
      const int c = (i * 32 + lane) * 4;
      if (c < cols) {
        float4 own = make_float4(rs * (gw[i].x - a - xh[i].x * bsum),
                                 rs * (gw[i].y - a - xh[i].y * bsum),
                                 rs * (gw[i].z - a - xh[i].z * bsum),
                                 rs * (gw[i].w - a - xh[i].w * bsum));
        if (dx_plus) {
          own = make_float4(add_rn(own.x, plus[i].x), add_rn(own.y, plus[i].y),
                            add_rn(own.z, plus[i].z), add_rn(own.w, plus[i].w));
        }
        store4(dx + r * cols + c, own);
      }
    }
  }
  // The warps' sums added in warp order.
  for (int j = 0; j < kWarpsPerBlock; ++j) {
    if (warp == j) {
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const int c = (i * 32 + lane) * 4;
        if (c < cols) {
          const float* pw = &aw[i].x;
          const float* pb = &ab[i].x;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            sums[c + k] = j == 0 ? pw[k] : sums[c + k] + pw[k];
            sums[cols + c + k] = j == 0 ? pb[k] : sums[cols + c + k] + pb[k];
          }
        }
      }
    }
    __syncthreads();
  }
  for (int c = threadIdx.x; c < cols; c += blockDim.x) {
    partial[chunk * cols + c] = sums[c];
    partial[(chunks + chunk) * cols + c] = sums[cols + c];
  }
}

bool aligned(const void* p, size_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

// Calls f with the register steps (V) for `cols` columns: 1, 2, 4 or 8.
template <class F>
void with_row_steps(int64_t cols, F&& f) {
  if (cols <= 128) {
    f(std::integral_constant<int, 1>{});
  } else if (cols <= 256) {
    f(std::integral_constant<int, 2>{});
  } else if (cols <= 512) {
    f(std::integral_constant<int, 4>{});
  } else {
    f(std::integral_constant<int, 8>{});
  }
}

// Whether the register kernels take a width of `cols` with these operands:
// 4 | cols <= kRowWidthMax, each pointer aligned to its 4-element load.
template <class... P>
bool row_kernels_fit(int64_t cols, const P*... p) {
  return cols % 4 == 0 && cols <= kRowWidthMax && (aligned(p, 4 * sizeof(P)) && ...);
}

template <class T, class Y>
void launch_layer_norm_forward(Stream s, Y* y, T* mean, T* rstd, const T* x, const T* w,
                               const T* b, int64_t rows, int64_t cols, double eps) {
  if (rows == 0) return;
  const unsigned grid = warp_rows_grid(rows);
  if constexpr (std::is_same_v<T, float>) {
    if (row_kernels_fit(cols, y, x, w, b)) {
      with_row_steps(cols, [&](auto steps) {
        layer_norm_forward_rows_kernel<Y, decltype(steps)::value>
            <<<grid, kWarpsPerBlock * 32, 0, as_cuda(s)>>>(y, mean, rstd, x, w, b, rows,
                                                           static_cast<int>(cols), float(eps));
      });
      LEASEHOLD_CUDA_CHECK(cudaGetLastError());
      return;
    }
  }
  layer_norm_forward_kernel<T, Y>
      <<<grid, kWarpsPerBlock * 32, 0, as_cuda(s)>>>(y, mean, rstd, x, w, b, rows, cols, T(eps));
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T, class G>
void launch_layer_norm_backward(Stream s, T* dx, const T* dx_plus, T* dw, T* db, T* workspace,
                                const G* dy, const T* x, const T* w, const T* mean,
                                const T* rstd, int64_t rows, int64_t cols, bool add_dw = false,
                                bool add_db = false) {
  if (cols == 0) return;
  cudaStream_t st = as_cuda(s);
  const int64_t chunks = layer_norm_row_chunks(rows);
  bool partials_done = false;
  if constexpr (std::is_same_v<T, float>) {
    if (rows > 0 && row_kernels_fit(cols, dx, dy, x, w) &&
        (dx_plus == nullptr || row_kernels_fit(cols, dx_plus))) {
      with_row_steps(cols, [&](auto steps) {
        layer_norm_backward_rows_kernel<G, decltype(steps)::value>
            <<<static_cast<unsigned>(chunks), kWarpsPerBlock * 32, 2 * cols * sizeof(float),
               st>>>(dx, dx_plus, workspace, dy, x, w, mean, rstd, rows, static_cast<int>(cols),
                     chunks);
      });
      LEASEHOLD_CUDA_CHECK(cudaGetLastError());
      partials_done = true;
    }
  }
  const dim3 grid(static_cast<unsigned>((cols + 31) / 32), static_cast<unsigned>(chunks));
  if (!partials_done) {
    if (rows > 0) {
      layer_norm_dx_kernel<T, G><<<warp_rows_grid(rows), kWarpsPerBlock * 32, 0, st>>>(
          dx, dx_plus, dy, x, w, mean, rstd, rows, cols);
      LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    }
    layer_norm_dwdb_partial_kernel<T, G><<<grid, 256, 0, st>>>(workspace, dy, x, mean, rstd,
                                                               rows, cols, chunks);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
  }
  // dw and db from the chunks' partial sums, in one launch.
  sum_parts_kernel<T><<<dim3(grid.x, 2), 32 * kPartLanes, 0, st>>>(dw, db, workspace, cols,
                                                                    chunks, add_dw, add_db);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

template <class T>
void layer_norm_forward(Stream s, T* y, T* mean, T* rstd, const T* x, const T* w, const T* b,
                        int64_t rows, int64_t cols, double eps) {
  launch_layer_norm_forward<T, T>(s, y, mean, rstd, x, w, b, rows, cols, eps);
}

template <class T>
void layer_norm_backward(Stream s, T* dx, const T* dx_plus, T* dw, T* db, T* workspace,
                         const T* dy, const T* x, const T* w, const T* mean, const T* rstd,
                         int64_t rows, int64_t cols) {
  launch_layer_norm_backward<T, T>(s, dx, dx_plus, dw, db, workspace, dy, x, w, mean, rstd, rows,
                                   cols);
}

void layer_norm_forward_bf16(Stream s, bfloat16* y, float* mean, float* rstd, const float* x,
                             const float* w, const float* b, int64_t rows, int64_t cols,
                             double eps) {
  launch_layer_norm_forward<float, bfloat16>(s, y, mean, rstd, x, w, b, rows, cols, eps);
}

void layer_norm_backward_bf16(Stream s, float* dx, const float* dx_plus, float* dw, float* db,
                              float* workspace, const bfloat16* dy, const float* x,
                              const float* w, const float* mean, const float* rstd, int64_t rows,
                              int64_t cols, bool add_dw, bool add_db) {
  launch_layer_norm_backward<float, bfloat16>(s, dx, dx_plus, dw, db, workspace, dy, x, w, mean,
                                              rstd, rows, cols, add_dw, add_db);
}

LEASEHOLD_LAYER_NORM_INSTANCES(float)
LEASEHOLD_LAYER_NORM_INSTANCES(double)

}  // namespace leasehold::kernels::cuda
