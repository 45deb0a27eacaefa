// A kernel that faults on purpose: tests of device-fault handling (an agent
// run with --test-device-fault-job) use it to end a CUDA context the way a
// buggy kernel would. Nothing else may call it.
#pragma once

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

namespace leasehold::kernels::cuda {
// Launches a kernel that writes to an unmapped device address: the context
// gets a sticky cudaErrorIllegalAddress (under MPS, every client's does).
void write_to_unmapped_address(cudaStream_t stream);
}  // namespace leasehold::kernels::cuda
#endif
