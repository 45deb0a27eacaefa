#include "kernels/pattern.h"
#include "kernels/pattern_cuda.h"
#include "shared/cuda_check.h"

#include <algorithm>

namespace leasehold::kernels {
namespace {

constexpr int kThreads = 256;

// Grid-stride loops: correct for any `words`, including ones that do not
// divide the block size, with a grid capped at what keeps the GPU busy.
__global__ void fill_pattern_kernel(uint64_t* dst, size_t words, uint64_t seed,
                                    uint64_t first_index) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words;
       i += size_t(gridDim.x) * blockDim.x) {
    dst[i] = pattern_word(seed, first_index + i);
  }
}

__global__ void count_mismatches_kernel(const uint64_t* src, size_t words, uint64_t seed,
                                        uint64_t first_index, unsigned long long* bad) {
  unsigned long long local = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < words;
       i += size_t(gridDim.x) * blockDim.x) {
    local += src[i] != pattern_word(seed, first_index + i);
  }
  if (local) atomicAdd(bad, local);
}

unsigned grid_for(size_t words) {
  size_t blocks = (words + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<size_t>(blocks, 1, 65535));
}

}  // namespace

void fill_pattern_cuda(uint64_t* dst, size_t words, uint64_t seed, uint64_t first_index,
                       cudaStream_t stream) {
  if (words == 0) return;
  fill_pattern_kernel<<<grid_for(words), kThreads, 0, stream>>>(dst, words, seed, first_index);
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

size_t count_mismatches_cuda(const uint64_t* src, size_t words, uint64_t seed,
                             uint64_t first_index, cudaStream_t stream) {
  if (words == 0) return 0;
  unsigned long long* bad = nullptr;
  LEASEHOLD_CUDA_CHECK(cudaMallocAsync(&bad, sizeof *bad, stream));
  unsigned long long host = 0;
  try {
    LEASEHOLD_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof *bad, stream));
    count_mismatches_kernel<<<grid_for(words), kThreads, 0, stream>>>(src, words, seed,
                                                                     first_index, bad);
    LEASEHOLD_CUDA_CHECK(cudaGetLastError());
    LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(&host, bad, sizeof host, cudaMemcpyDeviceToHost, stream));
    LEASEHOLD_CUDA_CHECK(cudaStreamSynchronize(stream));
  } catch (...) {
    cudaFreeAsync(bad, stream);
    throw;
  }
  LEASEHOLD_CUDA_CHECK(cudaFreeAsync(bad, stream));
  return static_cast<size_t>(host);
}

}  // namespace leasehold::kernels
