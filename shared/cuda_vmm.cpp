#include "shared/cuda_vmm.h"

#include <cuda_runtime_api.h>

#include <stdexcept>

namespace leasehold::detail {
namespace {

template <typename F>
void load(F& fn, const char* symbol) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found{};
  // 12000: the calls' signatures as of CUDA 12, which these are.
  if (cudaGetDriverEntryPointByVersion(symbol, &p, 12000, cudaEnableDefault, &found) !=
          cudaSuccess ||
      found != cudaDriverEntryPointSuccess || p == nullptr) {
    cudaGetLastError();
    throw std::runtime_error(std::string("the CUDA driver has no ") + symbol +
                             " (virtual memory management needs a driver for CUDA 12 or later)");
  }
  fn = reinterpret_cast<F>(p);
}

CudaVmm load_all() {
  CudaVmm v{};
  load(v.mem_create, "cuMemCreate");
  load(v.mem_release, "cuMemRelease");
  load(v.export_handle, "cuMemExportToShareableHandle");
  load(v.import_handle, "cuMemImportFromShareableHandle");
  load(v.address_reserve, "cuMemAddressReserve");
  load(v.address_free, "cuMemAddressFree");
  load(v.map, "cuMemMap");
  load(v.unmap, "cuMemUnmap");
  load(v.set_access, "cuMemSetAccess");
  load(v.retain_handle, "cuMemRetainAllocationHandle");
  load(v.granularity, "cuMemGetAllocationGranularity");
  load(v.error_name, "cuGetErrorName");
  return v;
}

}  // namespace

const CudaVmm& cuda_vmm() {
  static const CudaVmm vmm = load_all();
  return vmm;
}

std::string vmm_error(const char* call, CUresult r) {
  const char* name = nullptr;
  if (cuda_vmm().error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "unknown error";
  return std::string(call) + " failed: " + name;
}

}  // namespace leasehold::detail
