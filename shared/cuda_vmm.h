// The CUDA driver's virtual memory calls, reached through the runtime
// (cudaGetDriverEntryPointByVersion) rather than linked: the binaries then
// start on machines without a driver (CI), as everything else that uses
// only the runtime does. Only built with the CUDA backend.
#pragma once

#include <cuda.h>

#include <string>

namespace leasehold::detail {

struct CudaVmm {
  CUresult (*mem_create)(CUmemGenericAllocationHandle*, size_t, const CUmemAllocationProp*,
                         unsigned long long);
  CUresult (*mem_release)(CUmemGenericAllocationHandle);
  CUresult (*export_handle)(void*, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                            unsigned long long);
  CUresult (*import_handle)(CUmemGenericAllocationHandle*, void*, CUmemAllocationHandleType);
  CUresult (*address_reserve)(CUdeviceptr*, size_t, size_t, CUdeviceptr, unsigned long long);
  CUresult (*address_free)(CUdeviceptr, size_t);
  CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
  CUresult (*unmap)(CUdeviceptr, size_t);
  CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc*, size_t);
  CUresult (*retain_handle)(CUmemGenericAllocationHandle*, void*);
  CUresult (*granularity)(size_t*, const CUmemAllocationProp*, CUmemAllocationGranularity_flags);
  CUresult (*error_name)(CUresult, const char**);
};

// Loaded once; throws std::runtime_error when the driver lacks a call.
const CudaVmm& cuda_vmm();

// "cuMemMap failed: CUDA_ERROR_INVALID_VALUE".
std::string vmm_error(const char* call, CUresult r);

}  // namespace leasehold::detail
