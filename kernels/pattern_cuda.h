// CUDA twins of kernels/pattern.h. Both run on `stream`; the count
// synchronizes the stream to return its result. Throw CudaError on failure.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

namespace leasehold::kernels {

void fill_pattern_cuda(uint64_t* dst, size_t words, uint64_t seed, uint64_t first_index,
                       cudaStream_t stream);
size_t count_mismatches_cuda(const uint64_t* src, size_t words, uint64_t seed,
                             uint64_t first_index, cudaStream_t stream);

}  // namespace leasehold::kernels
