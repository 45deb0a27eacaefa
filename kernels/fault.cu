#include "kernels/fault.h"

#include "shared/cuda_check.h"

namespace leasehold::kernels::cuda {
namespace {
__global__ void write_unmapped(unsigned* p) { p[threadIdx.x] = 1u; }
}  // namespace

void write_to_unmapped_address(cudaStream_t stream) {
  // Address 16 is never mapped (the first pages of the device's virtual
  // address space are reserved).
  write_unmapped<<<1, 32, 0, stream>>>(reinterpret_cast<unsigned*>(16));
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}
}  // namespace leasehold::kernels::cuda
