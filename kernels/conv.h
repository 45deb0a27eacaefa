// Convolution helpers. In general conv2d is im2col followed by a GEMM, and
// its input gradient a GEMM followed by col2im. Tensors are contiguous NCHW;
// col is [N, C*KH*KW, OH*OW] with rows ordered (c, ki, kj).
//
// On CUDA, a convolution whose image, output gradient and weights fit a
// block's shared memory (LeNet's, a few channels of a small picture) runs
// direct kernels instead: the forward pass and the input gradient one block
// per image, the weight gradient per group of images and slice of rows; no
// column matrix, the bias added in place. For such shapes im2col, batched
// GEMMs too small to fill the GPU and col2im cost several times the
// arithmetic (measured: about 220 of LeNet's 560 µs of kernels per step on
// an H100 went to them).
#pragma once

#include <cstdint>

#include "kernels/pattern.h"  // LEASEHOLD_HOST_DEVICE
#include "kernels/stream.h"


namespace leasehold::kernels {

struct ConvGeometry {
  int64_t n = 0, c = 0, h = 0, w = 0;  // input
  int64_t kh = 0, kw = 0;              // kernel
  int64_t stride = 1, pad = 0;
  LEASEHOLD_HOST_DEVICE int64_t oh() const { return (h + 2 * pad - kh) / stride + 1; }
  LEASEHOLD_HOST_DEVICE int64_t ow() const { return (w + 2 * pad - kw) / stride + 1; }
};

// Max pooling, window k, stride s, no padding; NCHW contiguous. `argmax`
// holds, per output element, the flat index (h * W + w) of the chosen input.
struct PoolGeometry {
  int64_t n = 0, c = 0, h = 0, w = 0;
  int64_t k = 2, stride = 2;
  LEASEHOLD_HOST_DEVICE int64_t oh() const { return (h - k) / stride + 1; }
  LEASEHOLD_HOST_DEVICE int64_t ow() const { return (w - k) / stride + 1; }
};

// Shared memory the direct kernels may use per block: what every CUDA GPU
// gives a block without opting in to more.
inline constexpr int64_t kDirectConvSharedBytes = 48 * 1024;

// The direct weight gradient's partial sums stay within this many bytes
// (the im2col path's default column budget).
inline constexpr int64_t kMaxPartialBytes = 32ll << 20;

// How the direct kernels take one convolution (kernels/conv_plan.cpp).
struct DirectConvPlan {
  bool fits = false;  // every kernel's shared memory fits; else im2col + GEMM
  // Images are staged with zero columns (detail::direct_staged_width): when
  // that fits too.
  bool padded = false;
  // The input gradient as a convolution of the output gradient with the
  // flipped weights (stride 1, a square kernel larger than the padding),
  // else a gather per input position.
  bool input_as_convolution = false;
  // The weight gradient is summed per (group of images, slice of output
  // rows) into `partial` rows, which the caller sums.
  int64_t images_per_group = 1, rows_per_slice = 1, groups = 1, slices = 1;
  int64_t partial_rows() const { return groups * slices; }
};
DirectConvPlan plan_direct_conv(const ConvGeometry& g, int64_t out_channels,
                                int64_t element_bytes);

// Shared-memory layouts of the direct kernels, in elements. Weight and
// gradient rows of a block of output channels start 16-byte aligned and are
// read as 16-byte words.
namespace detail {
LEASEHOLD_HOST_DEVICE inline int64_t round8(int64_t v) { return (v + 7) / 8 * 8; }
// A convolution thread computes this many adjacent outputs of a row.
inline constexpr int64_t kDirectPositions = 4;
// Columns of an image row as the kernels stage it. Padded (where that
// fits): `pad` zeros each side, then zeros for a thread's last outputs that
// run past the row (their results are not stored), so the inner loops read
// without bounds checks. Else the row as it is.
LEASEHOLD_HOST_DEVICE inline int64_t direct_staged_width(int64_t w, int64_t pad, int64_t stride,
                                                       bool padded) {
  return padded ? w + 2 * pad + (kDirectPositions - 1) * stride : w;
}
// `image` below is the staged one: c · h · direct_staged_width(w, ...).
// Forward: [input image | weights [c·kh·kw][round8(out)] | bias [round8(out)]].
LEASEHOLD_HOST_DEVICE inline int64_t direct_forward_elements(int64_t image, int64_t ckk,
                                                           int64_t out_channels) {
  return round8(image) + (ckk + 1) * round8(out_channels);
}
// Weight gradient: [input image | output gradient [position][round8(O)]].
LEASEHOLD_HOST_DEVICE inline int64_t direct_weight_elements(int64_t image, int64_t positions,
                                                          int64_t out_channels) {
  return round8(image) + positions * round8(out_channels);
}
}  // namespace detail

#define LEASEHOLD_CONV_KERNELS(NS)                                                            \
  namespace NS {                                                                             \
  template <class T>                                                                         \
  void im2col(Stream s, T* col, const T* x, const ConvGeometry& g);                          \
  /* dx = col2im(dcol): sums every column entry back into its input position. */            \
  template <class T>                                                                         \
  void col2im(Stream s, T* dx, const T* dcol, const ConvGeometry& g);                        \
  template <class T>                                                                         \
  void max_pool(Stream s, T* out, int64_t* argmax, const T* x, const PoolGeometry& g);       \
  /* dx (zeroed by the caller) += gradient routed to each window's argmax. */                \
  template <class T>                                                                         \
  void max_pool_backward(Stream s, T* dx, const T* dout, const int64_t* argmax,              \
                         const PoolGeometry& g);                                             \
  }

// Explicit instantiations, expanded in conv_cpu.cpp and conv.cu.
#define LEASEHOLD_CONV_INSTANCES_OF(T)                                                    \
  template void im2col<T>(Stream, T*, const T*, const ConvGeometry&);                    \
  template void col2im<T>(Stream, T*, const T*, const ConvGeometry&);                    \
  template void max_pool<T>(Stream, T*, int64_t*, const T*, const PoolGeometry&);        \
  template void max_pool_backward<T>(Stream, T*, const T*, const int64_t*, const PoolGeometry&);

LEASEHOLD_CONV_KERNELS(cpu)
#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_CONV_KERNELS(cuda)
// CUDA only: the fast paths the engine picks by plan on a GPU.
namespace cuda {
// max_pool_backward for windows that do not overlap (stride >= k), into a
// dx that needs no zeroing: every element is written.
template <class T>
void max_pool_backward_disjoint(Stream s, T* dx, const T* dout, const int64_t* argmax,
                                const PoolGeometry& g);

// The direct kernels (plan_direct_conv(...).fits must hold). `w` is
// [O, C, KH, KW]; `bias` [O] or null. Outputs are written whole (no zeroing
// needed). `relu`: the output is relu(conv); its backward then passes the
// forward output as `mask` (dout counts where mask > 0), else null.
template <class T>
void conv2d_direct(Stream s, T* out, const T* x, const T* w, const T* bias,
                   const ConvGeometry& g, int64_t out_channels, const DirectConvPlan& plan,
                   bool relu);
template <class T>
void conv2d_direct_backward_input(Stream s, T* dx, const T* dout, const T* mask, const T* w,
                                  const ConvGeometry& g, int64_t out_channels,
                                  const DirectConvPlan& plan);
// partial: [plan.partial_rows(), O*C*KH*KW + O]: per row the weight
// gradient, then the bias's.
template <class T>
void conv2d_direct_backward_weight(Stream s, T* partial, const T* x, const T* dout,
                                   const T* mask, const ConvGeometry& g, int64_t out_channels,
                                   const DirectConvPlan& plan);
}  // namespace cuda
#endif
#undef LEASEHOLD_CONV_KERNELS

// One element of each, shared by the CPU loops and the CUDA kernels.
namespace detail {

// col element `idx` of [N, C*KH*KW, OH*OW].
template <class T>
LEASEHOLD_HOST_DEVICE inline T im2col_at(const T* x, const ConvGeometry& g, int64_t idx) {
  const int64_t oh = g.oh(), ow = g.ow(), ckk = g.c * g.kh * g.kw;
  int64_t p = idx % (oh * ow);
  int64_t row = (idx / (oh * ow)) % ckk;
  int64_t n = idx / (oh * ow * ckk);
  int64_t kj = row % g.kw, ki = (row / g.kw) % g.kh, c = row / (g.kw * g.kh);
  int64_t y = (p / ow) * g.stride - g.pad + ki;
  int64_t xx = (p % ow) * g.stride - g.pad + kj;
  if (y < 0 || y >= g.h || xx < 0 || xx >= g.w) return T(0);
  return x[((n * g.c + c) * g.h + y) * g.w + xx];
}

// dx element `idx` of [N, C, H, W]: gathers (no atomics) every col entry
// that read this input position.
template <class T>
LEASEHOLD_HOST_DEVICE inline T col2im_at(const T* dcol, const ConvGeometry& g, int64_t idx) {
  const int64_t oh = g.oh(), ow = g.ow(), ckk = g.c * g.kh * g.kw;
  int64_t xx = idx % g.w, y = (idx / g.w) % g.h, c = (idx / (g.w * g.h)) % g.c;
  int64_t n = idx / (g.w * g.h * g.c);
  T acc = 0;
  for (int64_t ki = 0; ki < g.kh; ++ki) {
    int64_t ty = y + g.pad - ki;
    if (ty < 0 || ty % g.stride != 0) continue;
    int64_t oy = ty / g.stride;
    if (oy >= oh) continue;
    for (int64_t kj = 0; kj < g.kw; ++kj) {
      int64_t tx = xx + g.pad - kj;
      if (tx < 0 || tx % g.stride != 0) continue;
      int64_t ox = tx / g.stride;
      if (ox >= ow) continue;
      int64_t row = (c * g.kh + ki) * g.kw + kj;
      acc += dcol[(n * ckk + row) * (oh * ow) + oy * ow + ox];
    }
  }
  return acc;
}

template <class T>
LEASEHOLD_HOST_DEVICE inline void max_pool_at(T* out, int64_t* argmax, const T* x,
                                              const PoolGeometry& g, int64_t idx) {
  const int64_t oh = g.oh(), ow = g.ow();
  int64_t ox = idx % ow, oy = (idx / ow) % oh, plane = idx / (ow * oh);
  const T* src = x + plane * g.h * g.w;
  int64_t best = (oy * g.stride) * g.w + ox * g.stride;
  for (int64_t i = 0; i < g.k; ++i) {
    for (int64_t j = 0; j < g.k; ++j) {
      int64_t at = (oy * g.stride + i) * g.w + ox * g.stride + j;
      T v = src[at], b = src[best];
      if (v > b || (v != v && b == b)) best = at;  // NaN propagates, as in PyTorch
    }
  }
  out[idx] = src[best];
  argmax[idx] = best;
}

}  // namespace detail
}  // namespace leasehold::kernels
