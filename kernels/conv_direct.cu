// Direct convolution kernels for small images with few channels (conv.h):
// a block stages an image (or its output gradient) and the weights in
// shared memory and computes from there. No column matrix, no atomics:
// results do not depend on scheduling.
//
// Shared-memory bandwidth is what limits such kernels, so each thread keeps
// a tile of results in registers: every value it reads serves several
// products, and the weights (or gradients) that all threads of a warp need
// are read as 16-byte words at one address (a broadcast).
#include <type_traits>

#include "kernels/conv.h"
#include "kernels/fast_div.h"
#include "kernels/launch.cuh"

namespace leasehold::kernels::cuda {
namespace {

constexpr int kOutBlock = 8;   // output channels one convolution thread computes
constexpr int kPositions = int(detail::kDirectPositions);  // adjacent outputs of a row it computes
constexpr int kGradBlock = 4;  // output channels one weight-gradient thread serves

// A convolution in 32-bit ints (every per-image index of a convolution the
// plan takes is below 48 KiB / sizeof(T)): c input channels of h×w, o
// output channels of oh×ow. `flipped`: the weights are read as
// w[ci][co][kh-1-ki][kw-1-kj] of a [c, o, kh, kw] tensor, which makes the
// input gradient of a stride-1 layer a convolution of its output gradient.
// The input may come with a mask (a fused ReLU's output): values count only
// where it is positive.
struct Direct {
  int c, h, w, kh, kw, stride, pad, oh, ow, o;
  bool flipped;
  bool relu = false;  // the output is relu(conv)
  // The image is staged with zero columns (DirectConvPlan::padded): the
  // kernels' Padded argument says the same.
  bool padded = false;
  // Divisions of the staging loops, as multiplies (fast_div.h): by wp(),
  // by round8(o), by kh · kw and by kw. with_divisors() sets them.
  FastDiv by_wp, by_op, by_kk, by_kw;
  Direct& with_divisors() {
    by_wp = FastDiv(wp());
    by_op = FastDiv(int(detail::round8(o)));
    by_kk = FastDiv(kh * kw);
    by_kw = FastDiv(kw);
    return *this;
  }
  LEASEHOLD_HOST_DEVICE int image() const { return c * h * w; }
  // A row of the image as staged in shared memory (conv.h).
  LEASEHOLD_HOST_DEVICE int wp() const {
    return int(detail::direct_staged_width(w, pad, stride, padded));
  }
  LEASEHOLD_HOST_DEVICE int staged_image() const { return c * h * wp(); }
  LEASEHOLD_HOST_DEVICE int ckk() const { return c * kh * kw; }
  LEASEHOLD_HOST_DEVICE int plane() const { return oh * ow; }
};

Direct direct_of(const ConvGeometry& g, int64_t out_channels, const DirectConvPlan& plan) {
  Direct d{int(g.c),      int(g.h),   int(g.w),    int(g.kh),   int(g.kw), int(g.stride),
           int(g.pad),    int(g.oh()), int(g.ow()), int(out_channels), false};
  d.padded = plan.padded;
  return d.with_divisors();
}

// The input gradient of `g` as the convolution `flipped` describes: its
// input is the output gradient, its output the input gradient.
Direct input_gradient_of(const ConvGeometry& g, int64_t out_channels,
                         const DirectConvPlan& plan) {
  Direct d{int(out_channels), int(g.oh()), int(g.ow()), int(g.kh), int(g.kw), 1,
           int(g.kh - 1 - g.pad), int(g.h), int(g.w), int(g.c), true};
  d.padded = plan.padded;
  return d.with_divisors();
}

// Threads per block: one per work item up to kBlock, and at least four
// warps, which fill shared memory (stage) before the work starts.
unsigned block_for(int64_t items) {
  return unsigned(std::clamp<int64_t>((items + 31) / 32 * 32, 128, kBlock));
}

// Dynamic shared memory, 16-byte aligned (conv.h's layouts rely on it).
template <class T>
__device__ T* shared_values() {
  extern __shared__ __align__(16) double direct_shared[];
  return reinterpret_cast<T*>(direct_shared);
}

// dst[i] = value(i) for i < count, into shared memory. Each thread has
// kStaged loads in flight: a block of a few warps filling shared memory one
// load per thread at a time would wait out the memory latency for every
// round (measured: most of these kernels' time, before).
// `slot(i)` places value i elsewhere than dst[i] (a transposing copy).
constexpr int kStaged = 8;
template <class T, class Value, class Slot>
__device__ inline void stage(T* dst, int count, Value value, Slot slot) {
  for (int base = threadIdx.x; base < count; base += kStaged * blockDim.x) {
    T v[kStaged];
#pragma unroll
    for (int b = 0; b < kStaged; ++b) {
      const int i = base + b * blockDim.x;
      v[b] = i < count ? value(i) : T(0);
    }
#pragma unroll
    for (int b = 0; b < kStaged; ++b) {
      const int i = base + b * blockDim.x;
      if (i < count) dst[slot(i)] = v[b];
    }
  }
}
template <class T, class Value>
__device__ inline void stage(T* dst, int count, Value value) {
  stage(dst, count, value, [](int i) { return i; });
}

// An image ([c][h][w] at src, counted where mask > 0 if there is a mask)
// into shared memory as [c][h][wp()]: padded, zero columns beside each row.
template <bool Padded, class T>
__device__ inline void stage_image(T* dst, const T* src, const T* mask, const Direct& g) {
  if constexpr (Padded) {
    stage(dst, g.staged_image(), [&](int i) {
      int col;
      const int row = g.by_wp.divide(i, col);
      col -= g.pad;
      const int at = row * g.w + col;
      return col >= 0 && col < g.w && (!mask || mask[at] > T(0)) ? src[at] : T(0);
    });
  } else {
    stage(dst, g.image(), [&](int i) { return !mask || mask[i] > T(0) ? src[i] : T(0); });
  }
}

// Column xx (of the image, -pad <= xx) of a staged row: padded, a plain
// read; else zero outside the image.
template <bool Padded, class T>
__device__ inline T column(const T* row, int xx, const Direct& g) {
  if constexpr (Padded) {
    return row[xx + g.pad];
  } else {
    return xx >= 0 && xx < g.w ? row[xx] : T(0);
  }
}

// N consecutive values from 16-byte aligned shared memory, as words.
template <class T, int N>
__device__ inline void load_words(T (&dst)[N], const T* src) {
  using W = Word<T>;
  static_assert(N % W::kLanes == 0, "whole words");
#pragma unroll
  for (int i = 0; i < N / W::kLanes; ++i) {
    const W v = reinterpret_cast<const W*>(src)[i];
#pragma unroll
    for (int j = 0; j < W::kLanes; ++j) dst[i * W::kLanes + j] = v.v[j];
  }
}

// The reverse: N values to 16-byte aligned shared memory, as words.
template <class T, int N>
__device__ inline void store_words(T* dst, const T (&src)[N]) {
  using W = Word<T>;
  static_assert(N % W::kLanes == 0, "whole words");
#pragma unroll
  for (int i = 0; i < N / W::kLanes; ++i) {
    W v;
#pragma unroll
    for (int j = 0; j < W::kLanes; ++j) v.v[j] = src[i * W::kLanes + j];
    reinterpret_cast<W*>(dst)[i] = v;
  }
}

// out[n, co, p] = bias[co] + sum over (ci, ki, kj) of weight(co, ci, ki, kj)
// · x[n, ci, ...]. A thread computes kOutBlock channels × kPositions
// adjacent positions of one output row, over every `parts`-th input
// channel; the `parts` lanes of an item are neighbours in a warp and add
// their sums with shuffles (the same order every run). KW > 0: stride 1 and
// a kernel KW wide, whose kPositions + KW - 1 input values of a row are
// read once for all KW taps.
template <class T, bool Padded, int KW>
__global__ void convolution_kernel(T* __restrict__ out, const T* __restrict__ x,
                                   const T* __restrict__ mask, const T* __restrict__ w,
                                   const T* __restrict__ bias, Direct g, int parts) {
  const int image = g.image(), ckk = g.ckk(), kk = g.kh * g.kw, L = g.plane(), wp = g.wp();
  const int op = int(detail::round8(g.o));
  T* xs = shared_values<T>();                       // [ci][h][wp]
  T* ws = xs + detail::round8(g.staged_image());    // [ci·kh·kw][op], zero beyond o
  T* bs = ws + ckk * op;                            // [op]
  const int64_t n = blockIdx.x;
  stage_image<Padded>(xs, x + n * image, mask ? mask + n * image : nullptr, g);
  stage(ws, ckk * op, [&](int i) {
    int co, k, kj;
    const int r = g.by_op.divide(i, co), ci = g.by_kk.divide(r, k), ki = g.by_kw.divide(k, kj);
    if (co >= g.o) return T(0);
    return g.flipped ? w[((ci * g.o + co) * g.kh + g.kh - 1 - ki) * g.kw + g.kw - 1 - kj]
                     : w[(co * g.c + ci) * kk + k];
  });
  stage(bs, op, [&](int i) { return bias && i < g.o ? bias[i] : T(0); });
  __syncthreads();

  const int across = (g.ow + kPositions - 1) / kPositions, per_block = g.oh * across;
  const int items = (op / kOutBlock) * per_block;
  // Whole warps go round together (the shuffles need every lane).
  const int lanes = (items * parts + 31) / 32 * 32;
  T* on = out + n * g.o * L;
  for (int t = threadIdx.x; t < lanes; t += blockDim.x) {
    const int item = t / parts, part = t - item * parts;
    const bool valid = item < items;
    const int ob = item / per_block * kOutBlock, rest = item % per_block;
    const int oy = rest / across, ox0 = rest % across * kPositions;
    const int y0 = oy * g.stride - g.pad, x0 = ox0 * g.stride - g.pad;
    T acc[kPositions][kOutBlock];
#pragma unroll
    for (int j = 0; j < kPositions; ++j) {
#pragma unroll
      for (int k = 0; k < kOutBlock; ++k) acc[j][k] = valid && part == 0 ? bs[ob + k] : T(0);
    }
    for (int ci = valid ? part : g.c; ci < g.c; ci += parts) {
      for (int ki = 0; ki < g.kh; ++ki) {
        const int y = y0 + ki;
        if (y < 0 || y >= g.h) continue;
        const T* row = xs + (ci * g.h + y) * wp;
        const T* wk = ws + (ci * kk + ki * g.kw) * op + ob;
        if constexpr (KW > 0) {
          T v[kPositions + KW - 1];
#pragma unroll
          for (int i = 0; i < kPositions + KW - 1; ++i) v[i] = column<Padded>(row, x0 + i, g);
#pragma unroll
          for (int kj = 0; kj < KW; ++kj) {
            T wv[kOutBlock];
            load_words(wv, wk + kj * op);
#pragma unroll
            for (int j = 0; j < kPositions; ++j) {
#pragma unroll
              for (int k = 0; k < kOutBlock; ++k) acc[j][k] += v[j + kj] * wv[k];
            }
          }
        } else {
          for (int kj = 0; kj < g.kw; ++kj) {
            T wv[kOutBlock];
            load_words(wv, wk + kj * op);
#pragma unroll
            for (int j = 0; j < kPositions; ++j) {
              const T v = column<Padded>(row, x0 + j * g.stride + kj, g);
#pragma unroll
              for (int k = 0; k < kOutBlock; ++k) acc[j][k] += v * wv[k];
            }
          }
        }
      }
    }
    for (int lane = parts / 2; lane > 0; lane /= 2) {
#pragma unroll
      for (int j = 0; j < kPositions; ++j) {
#pragma unroll
        for (int k = 0; k < kOutBlock; ++k) acc[j][k] += __shfl_xor_sync(~0u, acc[j][k], lane);
      }
    }
    if (!valid || part != 0) continue;
#pragma unroll
    for (int j = 0; j < kPositions; ++j) {
      if (ox0 + j >= g.ow) break;
#pragma unroll
      for (int k = 0; k < kOutBlock; ++k) {
        const T v = g.relu && !(acc[j][k] > T(0)) ? T(0) : acc[j][k];  // as UnaryOp::Relu
        if (ob + k < g.o) on[(ob + k) * L + oy * g.ow + ox0 + j] = v;
      }
    }
  }
}

// The input gradient where it is no convolution (stride > 1, a kernel that
// is not square, or padding as large as the kernel): dx[n, c, y, x] = sum
// over (o, ki, kj) of dout[n, o, oy, ox] w[o, c, ki, kj] where (oy, ox) ·
// stride = (y, x) + pad - (ki, kj); one thread per input position.
template <class T>
__global__ void gather_input_kernel(T* __restrict__ dx, const T* __restrict__ dout,
                                    const T* __restrict__ mask, const T* __restrict__ w,
                                    Direct g) {
  const int image = g.image(), ckk = g.ckk(), L = g.plane(), hw = g.h * g.w;
  T* gs = shared_values<T>();  // [o][oh·ow]
  T* ws = gs + g.o * L;        // [o][c][kh][kw]
  const int64_t n = blockIdx.x;
  const T* gn = dout + n * g.o * L;
  const T* mn = mask ? mask + n * g.o * L : nullptr;
  stage(gs, g.o * L, [&](int i) { return !mn || mn[i] > T(0) ? gn[i] : T(0); });
  stage(ws, g.o * ckk, [&](int i) { return w[i]; });
  __syncthreads();
  T* dxn = dx + n * image;
  for (int i = threadIdx.x; i < image; i += blockDim.x) {
    const int c = i / hw, pos = i - c * hw, y = pos / g.w, xx = pos - y * g.w;
    T acc = 0;
    for (int ki = 0; ki < g.kh; ++ki) {
      const int ty = y + g.pad - ki;
      if (ty < 0) break;  // and for every larger ki
      const int oy = ty / g.stride;
      if (oy * g.stride != ty || oy >= g.oh) continue;
      for (int kj = 0; kj < g.kw; ++kj) {
        const int tx = xx + g.pad - kj;
        if (tx < 0) break;
        const int ox = tx / g.stride;
        if (ox * g.stride != tx || ox >= g.ow) continue;
        const T* gp = gs + oy * g.ow + ox;
        const T* wp = ws + (c * g.kh + ki) * g.kw + kj;
        for (int o = 0; o < g.o; ++o) acc += gp[o * L] * wp[o * ckk];
      }
    }
    dxn[i] = acc;
  }
}

struct Split {
  int images_per_group, rows_per_slice, slices;
};

// partial[row, ...] for row = (group of images, slice of output rows): at
// o·ckk + r the gradient of w[o, r] (r = c, ki, kj), at O·ckk + o the
// bias's. A thread serves kGradBlock output channels and KW adjacent taps
// (c, ki, kj0 .. kj0 + KW - 1; KW divides kw): at each position it reads
// those channels' output gradients as one word, the same for the whole
// warp, and KW neighbouring input values, for kGradBlock · KW products.
template <class T, int KW, bool Padded>
__global__ void weight_gradient_kernel(T* __restrict__ partial, const T* __restrict__ x,
                                       const T* __restrict__ dout, const T* __restrict__ mask,
                                       Direct g, Split s, int64_t images, int parts) {
  const int image = g.image(), ckk = g.ckk(), L = g.plane(), wp = g.wp();
  const int op = int(detail::round8(g.o)), width = g.o * ckk + g.o;
  const int per_row = g.kw / KW, taps = g.c * g.kh * per_row;  // items per channel block
  const int items = (g.o + kGradBlock - 1) / kGradBlock * taps;
  T* xs = shared_values<T>();                       // [c][h][wp]
  T* gs = xs + detail::round8(g.staged_image());    // [position of the slice][op], zero beyond o
  const int row = blockIdx.x, group = row / s.slices, slice = row - group * s.slices;
  const int oy0 = slice * s.rows_per_slice, oy1 = min(g.oh, oy0 + s.rows_per_slice);
  const int positions = (oy1 - oy0) * g.ow;
  // `parts` neighbouring lanes share an item, each taking every parts-th
  // position of a row, and add up with shuffles at the end.
  const int item = (blockIdx.y * blockDim.x + threadIdx.x) / parts, part = threadIdx.x % parts;
  const bool active = item < items;
  const int ob = active ? item / taps * kGradBlock : 0, t = active ? item % taps : 0;
  const int kernel_row = t / per_row;  // c · kh + ki
  const int c = kernel_row / g.kh, ki = kernel_row - c * g.kh;
  const int kj0 = (t - kernel_row * per_row) * KW;
  const bool bias_too = t == 0;  // one thread per channel block also sums the bias's
  T acc[kGradBlock][KW] = {}, bacc[kGradBlock] = {};
  const int64_t first = int64_t(group) * s.images_per_group;
  const int64_t last = first + s.images_per_group < images ? first + s.images_per_group : images;
  for (int64_t n = first; n < last; ++n) {
    __syncthreads();  // the previous image is no longer read
    stage_image<Padded>(xs, x + n * image, static_cast<const T*>(nullptr), g);
    // Transposed on the way in, [position][channel]: consecutive threads
    // read consecutive positions of a channel, kStaged channels in flight,
    // and store them as words.
    const T* gn = dout + n * g.o * L + oy0 * g.ow;
    const T* mn = mask ? mask + n * g.o * L + oy0 * g.ow : nullptr;
    for (int p = threadIdx.x; p < positions; p += blockDim.x) {
      for (int co0 = 0; co0 < op; co0 += kStaged) {  // op is a multiple of kStaged
        T v[kStaged];
#pragma unroll
        for (int b = 0; b < kStaged; ++b) {
          const int co = co0 + b, at = co * L + p;
          v[b] = co < g.o && (!mn || mn[at] > T(0)) ? gn[at] : T(0);
        }
        store_words(gs + p * op + co0, v);
      }
    }
    __syncthreads();
    if (!active) continue;
    for (int oy = oy0; oy < oy1; ++oy) {
      const int y = oy * g.stride - g.pad + ki;
      const bool in_y = y >= 0 && y < g.h;
      if (!in_y && !bias_too) continue;
      const T* xrow = xs + (c * g.h + (in_y ? y : 0)) * wp;
      const T* grow = gs + (oy - oy0) * g.ow * op + ob;
      for (int ox = part; ox < g.ow; ox += parts) {
        T gv[kGradBlock];
        load_words(gv, grow + ox * op);
        if (in_y) {
          T v[KW];
#pragma unroll
          for (int j = 0; j < KW; ++j) {
            v[j] = column<Padded>(xrow, ox * g.stride - g.pad + kj0 + j, g);
          }
#pragma unroll
          for (int k = 0; k < kGradBlock; ++k) {
#pragma unroll
            for (int j = 0; j < KW; ++j) acc[k][j] += v[j] * gv[k];
          }
        }
        if (bias_too) {
#pragma unroll
          for (int k = 0; k < kGradBlock; ++k) bacc[k] += gv[k];
        }
      }
    }
  }
  for (int lane = parts / 2; lane > 0; lane /= 2) {
#pragma unroll
    for (int k = 0; k < kGradBlock; ++k) {
#pragma unroll
      for (int j = 0; j < KW; ++j) acc[k][j] += __shfl_xor_sync(~0u, acc[k][j], lane);
      bacc[k] += __shfl_xor_sync(~0u, bacc[k], lane);
    }
  }
  if (!active || part != 0) return;
  T* out = partial + int64_t(row) * width;
  const int r0 = kernel_row * g.kw + kj0;
#pragma unroll
  for (int k = 0; k < kGradBlock; ++k) {
    if (ob + k >= g.o) break;
#pragma unroll
    for (int j = 0; j < KW; ++j) out[(ob + k) * ckk + r0 + j] = acc[k][j];
    if (bias_too) out[g.o * ckk + ob + k] = bacc[k];
  }
}

// Lanes per work item (a power of two up to 8, at most `limit`) so that a
// block of kBlock threads has work for most of them: a block per image
// whose few items each run long would leave the SM waiting on latency.
int parts_for(int64_t items, int64_t limit) {
  int parts = 1;
  while (parts < 8 && parts * 2 <= limit && items * parts * 2 <= kBlock) parts *= 2;
  return parts;
}

template <class T>
void launch_convolution(T* out, const T* x, const T* mask, const T* w, const T* bias,
                        const Direct& d, int64_t images, cudaStream_t stream) {
  const int64_t op = detail::round8(d.o);
  const size_t bytes =
      size_t(detail::direct_forward_elements(d.staged_image(), d.ckk(), d.o)) * sizeof(T);
  const int64_t items = op / kOutBlock * d.oh * ((d.ow + kPositions - 1) / kPositions);
  const int parts = parts_for(items, d.c);
  const unsigned block = block_for(items * parts);
  // Padded images of stride-1 layers 5 or 3 wide (LeNet's, and the input
  // gradients of stride-1 layers) read each row's values once for every tap.
  const int kw = d.padded && d.stride == 1 ? d.kw : 0;
  if (kw == 5) {
    convolution_kernel<T, true, 5>
        <<<unsigned(images), block, bytes, stream>>>(out, x, mask, w, bias, d, parts);
  } else if (kw == 3) {
    convolution_kernel<T, true, 3>
        <<<unsigned(images), block, bytes, stream>>>(out, x, mask, w, bias, d, parts);
  } else if (d.padded) {
    convolution_kernel<T, true, 0>
        <<<unsigned(images), block, bytes, stream>>>(out, x, mask, w, bias, d, parts);
  } else {
    convolution_kernel<T, false, 0>
        <<<unsigned(images), block, bytes, stream>>>(out, x, mask, w, bias, d, parts);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

template <class T>
void conv2d_direct(Stream queue, T* out, const T* x, const T* w, const T* bias,
                   const ConvGeometry& g, int64_t out_channels, const DirectConvPlan& plan,
                   bool relu) {
  cudaStream_t stream = as_cuda(queue);
  Direct d = direct_of(g, out_channels, plan);
  d.relu = relu;
  launch_convolution<T>(out, x, nullptr, w, bias, d, g.n, stream);
}

template <class T>
void conv2d_direct_backward_input(Stream queue, T* dx, const T* dout, const T* mask, const T* w,
                                  const ConvGeometry& g, int64_t out_channels,
                                  const DirectConvPlan& plan) {
  cudaStream_t stream = as_cuda(queue);
  if (plan.input_as_convolution) {
    launch_convolution<T>(dx, dout, mask, w, nullptr, input_gradient_of(g, out_channels, plan),
                          g.n, stream);
    return;
  }
  const Direct d = direct_of(g, out_channels, plan);
  const size_t bytes = size_t(d.o * d.plane() + d.o * d.ckk()) * sizeof(T);
  gather_input_kernel<T><<<unsigned(g.n), block_for(d.image()), bytes, stream>>>(dx, dout, mask,
                                                                                  w, d);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

template <class T>
void conv2d_direct_backward_weight(Stream queue, T* partial, const T* x, const T* dout,
                                   const T* mask, const ConvGeometry& g, int64_t out_channels,
                                   const DirectConvPlan& plan) {
  cudaStream_t stream = as_cuda(queue);
  const Direct d = direct_of(g, out_channels, plan);
  const Split s{int(plan.images_per_group), int(plan.rows_per_slice), int(plan.slices)};
  const size_t bytes =
      size_t(detail::direct_weight_elements(d.staged_image(), plan.rows_per_slice * d.ow, d.o)) *
      sizeof(T);
  auto launch = [&](auto taps, auto padded) {
    constexpr int KW = decltype(taps)::value;
    const int64_t items = (d.o + kGradBlock - 1) / kGradBlock * d.c * d.kh * (d.kw / KW);
    const int parts = parts_for(items, d.ow);
    const unsigned block = block_for(items * parts);
    const dim3 grid(unsigned(plan.partial_rows()), unsigned((items * parts + block - 1) / block));
    weight_gradient_kernel<T, KW, decltype(padded)::value>
        <<<grid, block, bytes, stream>>>(partial, x, dout, mask, d, s, g.n, parts);
  };
  // Padded images: the widest tap group that divides the kernel's rows
  // (LeNet's 5, else 3, else one tap a thread). Images as they are (rare:
  // they do not fit padded): one tap a thread.
  using std::integral_constant;
  if (!d.padded) {
    launch(integral_constant<int, 1>{}, std::false_type{});
  } else if (d.kw % 5 == 0) {
    launch(integral_constant<int, 5>{}, std::true_type{});
  } else if (d.kw % 3 == 0) {
    launch(integral_constant<int, 3>{}, std::true_type{});
  } else {
    launch(integral_constant<int, 1>{}, std::true_type{});
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

#define LEASEHOLD_INSTANTIATE(T)                                                             \
  template void conv2d_direct<T>(Stream, T*, const T*, const T*, const T*, const ConvGeometry&, \
                                 int64_t, const DirectConvPlan&, bool);                       \
  template void conv2d_direct_backward_input<T>(Stream, T*, const T*, const T*, const T*,     \
                                                const ConvGeometry&, int64_t,                 \
                                                const DirectConvPlan&);                       \
  template void conv2d_direct_backward_weight<T>(Stream, T*, const T*, const T*, const T*,    \
                                                 const ConvGeometry&, int64_t,                \
                                                 const DirectConvPlan&);
LEASEHOLD_INSTANTIATE(float)
LEASEHOLD_INSTANTIATE(double)
#undef LEASEHOLD_INSTANTIATE

}  // namespace leasehold::kernels::cuda
