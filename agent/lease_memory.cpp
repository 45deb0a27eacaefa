#include "agent/lease_memory.h"

#include "kernels/pattern.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include "kernels/pattern_cuda.h"
#include "shared/cuda_check.h"
#endif

namespace leasehold {
namespace {

uint64_t* words_of(const Lease& lease) { return reinterpret_cast<uint64_t*>(lease.data()); }

}  // namespace

void fill_pool_pattern(Backend backend, int device, std::byte* at, size_t bytes, uint64_t seed) {
  auto* words = reinterpret_cast<uint64_t*>(at);
  const size_t count = bytes / sizeof(uint64_t);
  if (backend == Backend::Cuda) {
#ifdef LEASEHOLD_HAVE_CUDA
    // The current CUDA device is per thread: use the pool's.
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
    kernels::fill_pattern_cuda(words, count, seed, 0, cudaStreamPerThread);
    LEASEHOLD_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return;
#endif
  }
  (void)device;
  kernels::fill_pattern_cpu(words, count, seed, 0);
}

void fill_lease_pattern(const Lease& lease, uint64_t seed) {
  fill_pool_pattern(lease.backend(), lease.device(), lease.data(), lease.size(), seed);
}

size_t count_lease_mismatches(const Lease& lease, uint64_t seed) {
  size_t words = lease.size() / sizeof(uint64_t);
  if (lease.backend() == Backend::Cuda) {
#ifdef LEASEHOLD_HAVE_CUDA
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(lease.device()));
    return kernels::count_mismatches_cuda(words_of(lease), words, seed, 0, cudaStreamPerThread);
#endif
  }
  return kernels::count_mismatches_cpu(words_of(lease), words, seed, 0);
}

}  // namespace leasehold
