#include "agent/device_footprint.h"

#include <dlfcn.h>
#include <unistd.h>

#include <memory>
#include <optional>
#include <vector>

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "shared/cuda_check.h"
#endif

namespace leasehold {
namespace {

#ifdef LEASEHOLD_HAVE_CUDA
// The few NVML entry points used, declared as the driver's libnvidia-ml
// exports them (NVML's C ABI; its header is not part of the toolkit here).
// Loaded at run time: machines without a driver (CI) lack the library.
using NvmlReturn = int;
constexpr NvmlReturn kNvmlSuccess = 0;
constexpr NvmlReturn kNvmlInsufficientSize = 7;
constexpr unsigned long long kNvmlValueNotAvailable = ~0ULL;
struct NvmlDevice;
struct NvmlProcessInfo {  // nvmlProcessInfo_t, as the _v3 query fills it
  unsigned int pid;
  unsigned long long used_gpu_memory;
  unsigned int gpu_instance_id;
  unsigned int compute_instance_id;
};

std::optional<uint64_t> nvml_process_bytes(int device, pid_t pid) {
  void* lib = ::dlopen("libnvidia-ml.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return std::nullopt;
  std::unique_ptr<void, int (*)(void*)> closer(lib, &::dlclose);
  auto init = reinterpret_cast<NvmlReturn (*)()>(::dlsym(lib, "nvmlInit_v2"));
  auto shutdown = reinterpret_cast<NvmlReturn (*)()>(::dlsym(lib, "nvmlShutdown"));
  auto by_bus = reinterpret_cast<NvmlReturn (*)(const char*, NvmlDevice**)>(
      ::dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2"));
  auto processes = reinterpret_cast<NvmlReturn (*)(NvmlDevice*, unsigned int*, NvmlProcessInfo*)>(
      ::dlsym(lib, "nvmlDeviceGetComputeRunningProcesses_v3"));
  if (!init || !shutdown || !by_bus || !processes || init() != kNvmlSuccess) return std::nullopt;
  std::optional<uint64_t> found;
  char bus[64] = {0};
  NvmlDevice* handle = nullptr;
  if (cudaDeviceGetPCIBusId(bus, sizeof bus, device) == cudaSuccess &&
      by_bus(bus, &handle) == kNvmlSuccess) {
    unsigned int count = 0;
    NvmlReturn r = processes(handle, &count, nullptr);
    if (r == kNvmlInsufficientSize || (r == kNvmlSuccess && count > 0)) {
      std::vector<NvmlProcessInfo> infos(count + 8);
      count = static_cast<unsigned int>(infos.size());
      if (processes(handle, &count, infos.data()) == kNvmlSuccess) {
        for (unsigned int i = 0; i < count; ++i) {
          if (infos[i].pid == static_cast<unsigned int>(pid) &&
              infos[i].used_gpu_memory != kNvmlValueNotAvailable) {
            found = infos[i].used_gpu_memory;
          }
        }
      }
    }
  }
  shutdown();
  return found;
}

uint64_t free_bytes(int device) {
  size_t free = 0, total = 0;
  LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
  LEASEHOLD_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return free;
}
#endif

}  // namespace

FootprintProbe::FootprintProbe(engine::Device device) : device_(device) {
#ifdef LEASEHOLD_HAVE_CUDA
  if (device_.is_cuda()) free_before_ = free_bytes(device_.index);
#endif
}

Footprint FootprintProbe::measure() const {
  if (!device_.is_cuda()) return {0, "host backend: no device memory"};
#ifdef LEASEHOLD_HAVE_CUDA
  if (auto bytes = nvml_process_bytes(device_.index, ::getpid())) {
    return {*bytes, "NVML, this process"};
  }
  const uint64_t after = free_bytes(device_.index);
  return {free_before_ > after ? free_before_ - after : 0,
          "drop in free device memory across the warm-up (NVML has no figure for this "
          "process; the CUDA context itself is not counted)"};
#else
  return {0, "no CUDA in this build"};
#endif
}

std::optional<uint64_t> process_device_bytes(engine::Device device, pid_t pid) {
#ifdef LEASEHOLD_HAVE_CUDA
  if (device.is_cuda()) return nvml_process_bytes(device.index, pid);
#endif
  (void)device;
  (void)pid;
  return std::nullopt;
}

}  // namespace leasehold
