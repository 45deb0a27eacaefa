// The direct convolution plan (kernels/conv_plan.cpp) is host code: which
// convolutions the CUDA direct kernels take, and how the weight gradient
// splits a batch, checked without a GPU.
#include <gtest/gtest.h>

#include "kernels/conv.h"
#include "kernels/reduce.h"

namespace leasehold::kernels {
namespace {

TEST(DirectConvPlan, TakesLeNetsLayersAndLeavesLargeOrEmptyOnesToIm2col) {
  const ConvGeometry conv1{128, 1, 28, 28, 5, 5, 1, 2}, conv2{128, 6, 14, 14, 5, 5, 1, 0};
  const auto p1 = plan_direct_conv(conv1, 6, sizeof(float));
  const auto p2 = plan_direct_conv(conv2, 16, sizeof(float));
  EXPECT_TRUE(p1.fits && p1.input_as_convolution && p1.padded);
  EXPECT_TRUE(p2.fits && p2.input_as_convolution && p2.padded);
  // Stride 2 or a kernel that is not square: the input gradient is a gather.
  EXPECT_FALSE(plan_direct_conv({4, 3, 9, 9, 3, 3, 2, 1}, 8, sizeof(float)).input_as_convolution);
  EXPECT_FALSE(plan_direct_conv({4, 3, 9, 9, 3, 5, 1, 1}, 8, sizeof(float)).input_as_convolution);
  // An image of 16 channels of 40×40 does not fit 48 KiB.
  EXPECT_FALSE(plan_direct_conv({2, 16, 40, 40, 3, 3, 1, 1}, 4, sizeof(float)).fits);
  // Empty inputs and kernels, absurd strides and padding.
  EXPECT_FALSE(plan_direct_conv({2, 0, 9, 9, 3, 3, 1, 1}, 4, sizeof(float)).fits);
  EXPECT_FALSE(plan_direct_conv({2, 3, 9, 9, 0, 3, 1, 1}, 4, sizeof(float)).fits);
  EXPECT_FALSE(plan_direct_conv({2, 3, 9, 9, 3, 3, int64_t{1} << 40, 1}, 4, sizeof(float)).fits);
  EXPECT_FALSE(plan_direct_conv({2, 3, 9, 9, 3, 3, 1, int64_t{1} << 40}, 4, sizeof(float)).fits);
  // Doubles need twice the room. This one fits only with its images staged
  // as they are: the input gradient's padded rows would not.
  const auto unpadded = plan_direct_conv({2, 6, 24, 24, 5, 5, 1, 0}, 16, sizeof(float));
  EXPECT_TRUE(unpadded.fits);
  EXPECT_FALSE(unpadded.padded);
  EXPECT_FALSE(plan_direct_conv({2, 6, 24, 24, 5, 5, 1, 0}, 16, sizeof(double)).fits);
}

TEST(DirectConvPlan, PartialSumsCoverTheBatchAndStayBounded) {
  for (int64_t n : {int64_t{1}, int64_t{33}, int64_t{128}, int64_t{5000}, int64_t{1} << 20}) {
    for (const ConvGeometry& g : {ConvGeometry{n, 1, 28, 28, 5, 5, 1, 2},
                                  ConvGeometry{n, 6, 14, 14, 5, 5, 1, 0},
                                  ConvGeometry{n, 4, 12, 12, 5, 5, 1, 0}}) {
      const int64_t o = g.c == 1 ? 6 : g.c == 4 ? 32 : 16;
      const auto p = plan_direct_conv(g, o, sizeof(float));
      SCOPED_TRACE("n " + std::to_string(n) + ", c " + std::to_string(g.c));
      ASSERT_TRUE(p.fits);
      EXPECT_GE(p.groups * p.images_per_group, n) << "every image in a group";
      EXPECT_LT((p.groups - 1) * p.images_per_group, n) << "no empty group";
      EXPECT_GE(p.slices * p.rows_per_slice, g.oh()) << "every output row in a slice";
      EXPECT_LT((p.slices - 1) * p.rows_per_slice, g.oh()) << "no empty slice";
      EXPECT_LE(p.partial_rows(), kMaxColumnRows);
      const int64_t row_bytes = (o * g.c * g.kh * g.kw + o) * int64_t(sizeof(float));
      EXPECT_LE(p.partial_rows() * row_bytes, std::max(kMaxPartialBytes, p.slices * row_bytes));
    }
  }
}

}  // namespace
}  // namespace leasehold::kernels
