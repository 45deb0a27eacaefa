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

void fill_lease_pattern(const Lease& lease, uint64_t seed) {
  size_t words = lease.size() / sizeof(uint64_t);
  if (lease.backend() == Backend::Cuda) {
#ifdef LEASEHOLD_HAVE_CUDA
    // The current CUDA device is per thread: use the pool's.
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(lease.device()));
    kernels::fill_pattern_cuda(words_of(lease), words, seed, 0, cudaStreamPerThread);
    LEASEHOLD_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return;
#endif
  }
  kernels::fill_pattern_cpu(words_of(lease), words, seed, 0);
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
