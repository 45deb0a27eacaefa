// Pattern kernels: the CPU version's contract, and the CUDA version against it
// on awkward sizes (skipped without a GPU).
#include <gtest/gtest.h>

#include <vector>

#include "kernels/pattern.h"
#include "shared/device.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include "kernels/pattern_cuda.h"
#include "shared/cuda_check.h"
#endif

namespace leasehold::kernels {
namespace {

const size_t kSizes[] = {1, 3, 7, 33, 255, 256, 257, 1000, 1025, 1 << 20, (1 << 20) + 3};

TEST(PatternCpu, FillThenCountFindsNothingAndCatchesEachChange) {
  for (size_t n : kSizes) {
    std::vector<uint64_t> v(n);
    fill_pattern_cpu(v.data(), n, 42, 7);
    EXPECT_EQ(count_mismatches_cpu(v.data(), n, 42, 7), 0u);
    EXPECT_EQ(count_mismatches_cpu(v.data(), n, 43, 7), n) << "other seeds differ everywhere";
    v[n / 2] ^= 1;
    v[0] += 1;
    EXPECT_EQ(count_mismatches_cpu(v.data(), n, 42, 7), n == 1 ? 1u : 2u);
  }
}

#ifdef LEASEHOLD_HAVE_CUDA
TEST(PatternCuda, MatchesCpuOnAwkwardSizes) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: test skipped";
  cudaStream_t stream;
  LEASEHOLD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (size_t n : kSizes) {
    uint64_t* d = nullptr;
    LEASEHOLD_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d), n * sizeof(uint64_t)));
    // Poison first so an unwritten word shows up.
    LEASEHOLD_CUDA_CHECK(cudaMemsetAsync(d, 0xFF, n * sizeof(uint64_t), stream));
    fill_pattern_cuda(d, n, 99, 5, stream);
    std::vector<uint64_t> got(n), want(n);
    LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(got.data(), d, n * sizeof(uint64_t),
                                         cudaMemcpyDeviceToHost, stream));
    LEASEHOLD_CUDA_CHECK(cudaStreamSynchronize(stream));
    fill_pattern_cpu(want.data(), n, 99, 5);
    EXPECT_EQ(got, want) << "n=" << n;
    EXPECT_EQ(count_mismatches_cuda(d, n, 99, 5, stream), 0u);
    EXPECT_EQ(count_mismatches_cuda(d, n, 98, 5, stream), count_mismatches_cpu(got.data(), n, 98, 5));
    LEASEHOLD_CUDA_CHECK(cudaFree(d));
  }
  LEASEHOLD_CUDA_CHECK(cudaStreamDestroy(stream));
}
#endif

}  // namespace
}  // namespace leasehold::kernels
