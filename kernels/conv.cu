#include "kernels/conv.h"
#include "kernels/fast_div.h"
#include "kernels/launch.cuh"

namespace leasehold::kernels::cuda {
namespace {

template <class T>
__global__ void im2col_kernel(T* col, const T* x, ConvGeometry g, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    col[i] = detail::im2col_at(x, g, i);
  }
}

template <class T>
__global__ void col2im_kernel(T* dx, const T* dcol, ConvGeometry g, int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    dx[i] = detail::col2im_at(dcol, g, i);
  }
}

template <class T>
__global__ void max_pool_kernel(T* out, int64_t* argmax, const T* x, PoolGeometry g,
                                int64_t total) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    detail::max_pool_at(out, argmax, x, g, i);
  }
}

// Overlapping windows (stride < k) can route two gradients to one input.
template <class T>
__global__ void max_pool_backward_kernel(T* dx, const T* dout, const int64_t* argmax,
                                         PoolGeometry g, int64_t total) {
  int64_t per_plane = g.oh() * g.ow();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    atomicAdd(dx + (i / per_plane) * g.h * g.w + argmax[i], dout[i]);
  }
}

// Windows that do not overlap (stride >= k): each input position lies in at
// most one window, so every dx element is written once, from its window's
// argmax, with no zeroing beforehand and no atomics.
template <class T>
__global__ void max_pool_backward_gather_kernel(T* dx, const T* dout, const int64_t* argmax,
                                                PoolGeometry g, int64_t total) {
  const int64_t oh = g.oh(), ow = g.ow();
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t pos = i % (g.h * g.w), plane = i / (g.h * g.w);
    const int64_t y = pos / g.w, x = pos % g.w, oy = y / g.stride, ox = x / g.stride;
    T v = 0;
    if (oy < oh && ox < ow && y - oy * g.stride < g.k && x - ox * g.stride < g.k) {
      const int64_t out = (plane * oh + oy) * ow + ox;
      if (argmax[out] == pos) v = dout[out];
    }
    dx[i] = v;
  }
}

// The same three where every index of the input and output fits an int
// (kFits32), with the divisions by the geometry as multiplies: the 64-bit
// ones above are emulated, dozens of instructions each.
struct Pool32 {
  int h, w, oh, ow, k, stride;
  FastDiv by_w, by_ow, by_stride, by_plane, by_out_plane;  // h·w and oh·ow
  explicit Pool32(const PoolGeometry& g)
      : h(int(g.h)), w(int(g.w)), oh(int(g.oh())), ow(int(g.ow())), k(int(g.k)),
        stride(int(g.stride)), by_w(w), by_ow(ow), by_stride(stride), by_plane(h * w),
        by_out_plane(oh * ow) {}
};

template <class T>
__global__ void max_pool32_kernel(T* __restrict__ out, int64_t* __restrict__ argmax,
                                  const T* __restrict__ x, Pool32 g, int total) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    int rest, ox;
    const int plane = g.by_out_plane.divide(i, rest), oy = g.by_ow.divide(rest, ox);
    const T* src = x + plane * g.h * g.w;
    int best = oy * g.stride * g.w + ox * g.stride;
    T b = src[best];
    for (int ki = 0; ki < g.k; ++ki) {
      for (int kj = 0; kj < g.k; ++kj) {
        const int at = (oy * g.stride + ki) * g.w + ox * g.stride + kj;
        const T v = src[at];
        if (v > b || (v != v && b == b)) {  // as detail::max_pool_at
          best = at;
          b = v;
        }
      }
    }
    out[i] = b;
    argmax[i] = best;
  }
}

template <class T>
__global__ void max_pool32_backward_kernel(T* dx, const T* __restrict__ dout,
                                           const int64_t* __restrict__ argmax, Pool32 g,
                                           int total) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    atomicAdd(dx + g.by_out_plane.divide(i) * g.h * g.w + int(argmax[i]), dout[i]);
  }
}

template <class T>
__global__ void max_pool32_backward_gather_kernel(T* __restrict__ dx, const T* __restrict__ dout,
                                                  const int64_t* __restrict__ argmax, Pool32 g,
                                                  int total) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    int pos, x, dy, dx_in;
    const int plane = g.by_plane.divide(i, pos), y = g.by_w.divide(pos, x);
    const int oy = g.by_stride.divide(y, dy), ox = g.by_stride.divide(x, dx_in);
    T v = 0;
    if (oy < g.oh && ox < g.ow && dy < g.k && dx_in < g.k) {
      const int at = (plane * g.oh + oy) * g.ow + ox;
      if (argmax[at] == pos) v = dout[at];
    }
    dx[i] = v;
  }
}

// The element maps of detail::im2col_at and col2im_at in 32-bit index
// arithmetic. The GPU emulates 64-bit division, and the general kernels
// above did about nine per element: they ran at about 200 GB/s (an H100,
// LeNet's convolutions). Used when every index fits (kFits32).
constexpr int64_t kFits32 = int64_t{1} << 30;  // room for the grid stride
struct Geo32 {
  int c, h, w, kh, kw, stride, pad, oh, ow;
  explicit Geo32(const ConvGeometry& g)
      : c(int(g.c)), h(int(g.h)), w(int(g.w)), kh(int(g.kh)), kw(int(g.kw)),
        stride(int(g.stride)), pad(int(g.pad)), oh(int(g.oh())), ow(int(g.ow())) {}
};

template <class T>
__global__ void im2col32_kernel(T* __restrict__ col, const T* __restrict__ x, Geo32 g, int total) {
  const int L = g.oh * g.ow, kk = g.kh * g.kw, ckk = g.c * kk;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int t = i / L, p = i - t * L;
    const int n = t / ckk, row = t - n * ckk;
    const int c = row / kk, r = row - c * kk;
    const int ki = r / g.kw, kj = r - ki * g.kw;
    const int oy = p / g.ow, ox = p - oy * g.ow;
    const int y = oy * g.stride - g.pad + ki, xx = ox * g.stride - g.pad + kj;
    col[i] = (y < 0 || y >= g.h || xx < 0 || xx >= g.w) ? T(0)
                                                         : x[((n * g.c + c) * g.h + y) * g.w + xx];
  }
}

template <class T>
__global__ void col2im32_kernel(T* __restrict__ dx, const T* __restrict__ dcol, Geo32 g,
                                int total) {
  const int L = g.oh * g.ow, ckk = g.c * g.kh * g.kw;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
    const int plane = i / (g.h * g.w), pos = i - plane * (g.h * g.w);
    const int n = plane / g.c, c = plane - n * g.c;
    const int y = pos / g.w, xx = pos - y * g.w;
    const T* base = dcol + n * ckk * L;
    T acc = 0;
    for (int ki = 0; ki < g.kh; ++ki) {
      const int ty = y + g.pad - ki;
      if (ty < 0 || ty % g.stride != 0) continue;
      const int oy = ty / g.stride;
      if (oy >= g.oh) continue;
      for (int kj = 0; kj < g.kw; ++kj) {
        const int tx = xx + g.pad - kj;
        if (tx < 0 || tx % g.stride != 0) continue;
        const int ox = tx / g.stride;
        if (ox >= g.ow) continue;
        acc += base[((c * g.kh + ki) * g.kw + kj) * L + oy * g.ow + ox];
      }
    }
    dx[i] = acc;
  }
}

}  // namespace

template <class T>
void im2col(Stream queue, T* col, const T* x, const ConvGeometry& g) {
  cudaStream_t stream = as_cuda(queue);
  int64_t total = g.n * g.c * g.kh * g.kw * g.oh() * g.ow();
  if (total == 0) return;
  if (total < kFits32 && g.n * g.c * g.h * g.w < kFits32) {
    im2col32_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(col, x, Geo32(g), int(total));
  } else {
    im2col_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(col, x, g, total);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void col2im(Stream queue, T* dx, const T* dcol, const ConvGeometry& g) {
  cudaStream_t stream = as_cuda(queue);
  int64_t total = g.n * g.c * g.h * g.w;
  if (total == 0) return;
  if (total < kFits32 && g.n * g.c * g.kh * g.kw * g.oh() * g.ow() < kFits32) {
    col2im32_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(dx, dcol, Geo32(g), int(total));
  } else {
    col2im_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(dx, dcol, g, total);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

// Whether a pooling's input, output and stride all index in int.
static bool pool_fits32(const PoolGeometry& g) {
  return g.n * g.c * g.h * g.w < kFits32 && g.n * g.c * g.oh() * g.ow() < kFits32 &&
         g.stride < kFits32;
}

template <class T>
void max_pool(Stream queue, T* out, int64_t* argmax, const T* x, const PoolGeometry& g) {
  cudaStream_t stream = as_cuda(queue);
  int64_t total = g.n * g.c * g.oh() * g.ow();
  if (total == 0) return;
  if (pool_fits32(g)) {
    max_pool32_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(out, argmax, x, Pool32(g),
                                                                 int(total));
  } else {
    max_pool_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(out, argmax, x, g, total);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void max_pool_backward_disjoint(Stream queue, T* dx, const T* dout, const int64_t* argmax,
                                const PoolGeometry& g) {
  cudaStream_t stream = as_cuda(queue);
  int64_t total = g.n * g.c * g.h * g.w;
  if (total == 0) return;
  if (pool_fits32(g)) {
    max_pool32_backward_gather_kernel<T>
        <<<grid_for(total), kBlock, 0, stream>>>(dx, dout, argmax, Pool32(g), int(total));
  } else {
    max_pool_backward_gather_kernel<T>
        <<<grid_for(total), kBlock, 0, stream>>>(dx, dout, argmax, g, total);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void max_pool_backward(Stream queue, T* dx, const T* dout, const int64_t* argmax,
                       const PoolGeometry& g) {
  cudaStream_t stream = as_cuda(queue);
  int64_t total = g.n * g.c * g.oh() * g.ow();
  if (total == 0) return;
  if (pool_fits32(g)) {
    max_pool32_backward_kernel<T>
        <<<grid_for(total), kBlock, 0, stream>>>(dx, dout, argmax, Pool32(g), int(total));
  } else {
    max_pool_backward_kernel<T><<<grid_for(total), kBlock, 0, stream>>>(dx, dout, argmax, g, total);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

LEASEHOLD_CONV_INSTANCES_OF(float)
LEASEHOLD_CONV_INSTANCES_OF(double)
template void max_pool_backward_disjoint<float>(Stream, float*, const float*, const int64_t*,
                                                const PoolGeometry&);
template void max_pool_backward_disjoint<double>(Stream, double*, const double*, const int64_t*,
                                                 const PoolGeometry&);

}  // namespace leasehold::kernels::cuda
