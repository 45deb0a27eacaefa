// Whether and how the direct convolution kernels (conv_direct.cu) take a
// convolution. Host code only, so the engine can ask without CUDA.
#include <algorithm>

#include "kernels/conv.h"
#include "kernels/reduce.h"  // kMaxColumnRows

namespace leasehold::kernels {

DirectConvPlan plan_direct_conv(const ConvGeometry& g, int64_t out_channels,
                                int64_t element_bytes) {
  DirectConvPlan plan;
  const int64_t oh = g.oh(), ow = g.ow(), o = out_channels;
  // The kernels index per image in 32-bit ints (shared memory bounds the
  // sizes below; stride and padding are bounded here) and need something
  // to sum: an empty input or kernel is left to im2col + GEMM.
  constexpr int64_t kIntLimit = int64_t{1} << 30;
  if (g.n < 1 || g.n >= (int64_t{1} << 31) || g.c < 1 || g.kh < 1 || g.kw < 1 || oh < 1 ||
      ow < 1 || o < 1 || g.stride < 1 || g.stride >= kIntLimit || g.pad >= kIntLimit) {
    return plan;
  }
  plan.input_as_convolution = g.stride == 1 && g.kh == g.kw && g.pad < g.kh;
  const int64_t ckk = g.c * g.kh * g.kw, out = o * oh * ow;
  // About 256 output positions per block of the weight gradient: slices of
  // rows of larger outputs, and whole images, grouped only where one has
  // fewer than 128 (a block per image is short enough to keep a step's
  // chain of kernels short). Fewer makes more partial rows to sum; more
  // leaves too few blocks to fill the GPU.
  constexpr int64_t kPositionsPerBlock = 256, kImagePositionsPerBlock = 128;
  plan.rows_per_slice = std::clamp<int64_t>(kPositionsPerBlock / ow, 1, oh);
  plan.slices = (oh + plan.rows_per_slice - 1) / plan.rows_per_slice;
  plan.images_per_group =
      plan.slices == 1 ? std::clamp<int64_t>(kImagePositionsPerBlock / (oh * ow), 1, g.n) : 1;
  plan.groups = (g.n + plan.images_per_group - 1) / plan.images_per_group;
  // The partial sums stay within kMaxPartialBytes (and kMaxColumnRows,
  // for the column sum after them): a larger batch gets larger groups.
  const int64_t row_bytes = (o * ckk + o) * element_bytes;
  const int64_t max_rows =
      std::clamp<int64_t>(kMaxPartialBytes / std::max<int64_t>(row_bytes, 1), 1, kMaxColumnRows);
  if (plan.groups * plan.slices > max_rows) {
    const int64_t groups = std::max<int64_t>(1, max_rows / plan.slices);
    plan.images_per_group = (g.n + groups - 1) / groups;
    plan.groups = (g.n + plan.images_per_group - 1) / plan.images_per_group;
  }

  // Whether every kernel's shared memory fits, with images staged padded
  // or as they are (a staged row alone larger than shared memory cannot).
  const auto fits = [&](bool padded) {
    const int64_t width = detail::direct_staged_width(g.w, g.pad, g.stride, padded);
    // The input gradient as a convolution: the output gradient is its
    // image, O input channels, C output channels, padding kh - 1 - pad.
    const int64_t grad_width =
        plan.input_as_convolution ? detail::direct_staged_width(ow, g.kh - 1 - g.pad, 1, padded)
                                  : ow;
    // (Elements against bytes: a row of more elements than shared memory
    // has bytes cannot fit, and the products below stay far from overflow.)
    if (width > kDirectConvSharedBytes || grad_width > kDirectConvSharedBytes) return false;
    const int64_t image = g.c * g.h * width;
    const int64_t input_grad =
        plan.input_as_convolution
            ? detail::direct_forward_elements(o * oh * grad_width, o * g.kh * g.kw, g.c)
            : out + o * ckk;
    const int64_t need =
        std::max({detail::direct_forward_elements(image, ckk, o), input_grad,
                  detail::direct_weight_elements(image, plan.rows_per_slice * ow, o)});
    return need * element_bytes <= kDirectConvSharedBytes;
  };
  plan.padded = fits(true);
  plan.fits = plan.padded || fits(false);
  return plan;
}

}  // namespace leasehold::kernels
