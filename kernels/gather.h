// Row gathers: out[i] = src[index[i]] for whole rows of a contiguous
// matrix. The data loader builds batches this way from a dataset resident on
// the device (a shared cache region), so a batch costs no host work and no
// host-to-device copy.
#pragma once

#include <cstdint>

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace leasehold::kernels {

namespace cpu {
// REQUIRES: every index in [0, rows of src) (the caller checks).
void take_rows(void* out, const void* src, const int64_t* index, int64_t count,
               int64_t row_bytes);
}  // namespace cpu

#ifdef LEASEHOLD_HAVE_CUDA
namespace cuda {
// `index` in device memory. REQUIRES: every index in range (not checked on
// the device: the caller builds the indices). Rows move 16 bytes at a time
// when their size and the pointers allow it.
void take_rows(void* out, const void* src, const int64_t* index, int64_t count,
               int64_t row_bytes, cudaStream_t stream);
}  // namespace cuda
#endif

}  // namespace leasehold::kernels
