// CUDA backend: the pool is one cudaMalloc; agents open it through its CUDA
// IPC handle. Only built when the CUDA toolkit is found.
#include <spdlog/spdlog.h>

#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "shared/cuda_check.h"
#include "shared/detail/backends.h"
#include "shared/units.h"

namespace leasehold::detail {

std::string uuid_text(const cudaUUID_t& uuid);

namespace {

class CudaPool final : public DevicePool {
 public:
  CudaPool(int device, uint64_t size, uint64_t alignment) : device_(device) {
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
    cudaError_t err = cudaMalloc(&ptr_, size);
    if (err != cudaSuccess) {
      size_t free_b = 0, total_b = 0;
      cudaGetLastError();
      cudaMemGetInfo(&free_b, &total_b);
      throw std::runtime_error("cudaMalloc of a " + format_bytes(size) + " pool on device " +
                               std::to_string(device) + " failed: " + cudaGetErrorString(err) +
                               " (free " + format_bytes(free_b) + " of " + format_bytes(total_b) +
                               ")");
    }
    try {
      // cudaMalloc's base alignment is far below the 2 MiB lease alignment, but
      // lease offsets are relative to this base, so only relative alignment
      // matters; warn if the base is not even 256-byte aligned.
      if (reinterpret_cast<uintptr_t>(ptr_) % 256 != 0) {
        spdlog::warn("cudaMalloc returned a pool base that is not 256-byte aligned");
      }
      cudaIpcMemHandle_t handle;
      LEASEHOLD_CUDA_CHECK(cudaIpcGetMemHandle(&handle, ptr_));
      cudaDeviceProp prop{};
      LEASEHOLD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
      desc_.backend = Backend::Cuda;
      desc_.device = device;
      desc_.device_name = prop.name;
      desc_.size = size;
      desc_.alignment = alignment;
      desc_.handle.resize(sizeof handle);
      std::memcpy(desc_.handle.data(), &handle, sizeof handle);
      desc_.epoch = random_epoch();
      desc_.uuid = uuid_text(prop.uuid);
    } catch (...) {
      cudaFree(ptr_);
      throw;
    }
  }
  ~CudaPool() override {
    // Never throws; tolerates the runtime being unloaded at process exit.
    cudaError_t err = cudaFree(ptr_);
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      spdlog::error("cudaFree of the pool on device {} failed: {}", device_,
                    cudaGetErrorString(err));
    }
  }

 private:
  int device_;
  void* ptr_ = nullptr;
};

// A failed call's error is also the thread's "last error" until someone
// takes it: inside another program (the PyTorch plug-in) it would surface
// in that program's next error check. Take it.
cudaError_t cleared(cudaError_t err) {
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

// Makes `device` current for its lifetime and then the caller's again: the
// mapping runs inside other programs' processes (the PyTorch plug-in),
// whose current device is theirs. cudaGetDevice/cudaSetDevice only: no
// synchronization.
class DeviceSwitch {
 public:
  explicit DeviceSwitch(int device) {
    LEASEHOLD_CUDA_CHECK(cleared(cudaGetDevice(&previous_)));
    if (previous_ != device) LEASEHOLD_CUDA_CHECK(cleared(cudaSetDevice(device)));
    device_ = device;
  }
  DeviceSwitch(const DeviceSwitch&) = delete;
  DeviceSwitch& operator=(const DeviceSwitch&) = delete;
  // Back to the caller's device, throwing when that fails (call before a
  // successful return; the destructor covers the other paths).
  void restore() {
    if (restored_) return;
    restored_ = true;
    if (previous_ != device_) LEASEHOLD_CUDA_CHECK(cleared(cudaSetDevice(previous_)));
  }
  // Never throws: logs a failure (not when the runtime is unloading at exit).
  ~DeviceSwitch() {
    if (restored_ || previous_ == device_) return;
    cudaError_t err = cleared(cudaSetDevice(previous_));
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      spdlog::warn("could not make device {} current again: {}", previous_,
                   cudaGetErrorString(err));
    }
  }

 private:
  int previous_ = 0;
  int device_ = 0;
  bool restored_ = false;
};

// The pool opened through its IPC handle on the pool's device. The calling
// thread's current device is the same afterwards, whatever happens.
class CudaMapping final : public PoolMapping {
 public:
  explicit CudaMapping(const PoolDescriptor& desc) {
    cudaIpcMemHandle_t handle;
    if (desc.handle.size() != sizeof handle) {
      throw std::runtime_error("CUDA IPC handle has " + std::to_string(desc.handle.size()) +
                               " bytes, expected " + std::to_string(sizeof handle));
    }
    std::memcpy(&handle, desc.handle.data(), sizeof handle);
    DeviceSwitch on(desc.device);
    void* ptr = nullptr;
    cudaError_t err = cudaIpcOpenMemHandle(&ptr, handle, cudaIpcMemLazyEnablePeerAccess);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw std::runtime_error("cannot map CUDA pool on device " + std::to_string(desc.device) +
                               ": cudaIpcOpenMemHandle failed: " + cudaGetErrorString(err));
    }
    try {
      on.restore();
    } catch (...) {
      if (cudaError_t close = cleared(cudaIpcCloseMemHandle(ptr)); close != cudaSuccess) {
        spdlog::warn("cudaIpcCloseMemHandle failed: {}", cudaGetErrorString(close));
      }
      throw;
    }
    desc_ = desc;
    base_ = static_cast<std::byte*>(ptr);
  }
  ~CudaMapping() override {
    // Never throws; tolerates the runtime being unloaded at process exit.
    // Closed on the device it was opened on, and the caller's device again
    // afterwards.
    auto check = [](cudaError_t err, const char* what) {
      cleared(err);
      if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
        spdlog::warn("{} failed: {}", what, cudaGetErrorString(err));
      }
      return err == cudaSuccess;
    };
    int previous = -1;
    if (!check(cudaGetDevice(&previous), "cudaGetDevice")) previous = -1;
    const bool switched =
        previous != desc_.device && check(cudaSetDevice(desc_.device), "cudaSetDevice");
    check(cudaIpcCloseMemHandle(base_), "cudaIpcCloseMemHandle");
    if (switched && previous >= 0) check(cudaSetDevice(previous), "cudaSetDevice (back)");
  }
};

}  // namespace

// The 16 bytes as nvidia-smi -L and NVML print them: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx.
std::string uuid_text(const cudaUUID_t& uuid) {
  std::string out = "GPU-";
  char hex[3];
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    std::snprintf(hex, sizeof hex, "%02x", static_cast<unsigned char>(uuid.bytes[i]));
    out += hex;
  }
  return out;
}

std::unique_ptr<DevicePool> create_cuda_pool(int device, uint64_t size, uint64_t alignment) {
  return std::make_unique<CudaPool>(device, size, alignment);
}

std::unique_ptr<PoolMapping> map_cuda_pool(const PoolDescriptor& desc) {
  return std::make_unique<CudaMapping>(desc);
}

int cuda_ordinal_of(std::string_view uuid) {
  const int count = cuda_visible_devices();
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cleared(cudaGetDeviceProperties(&prop, i)) == cudaSuccess && uuid_text(prop.uuid) == uuid) {
      return i;
    }
  }
  return -1;
}

DeviceMemory query_cuda_memory(int device) {
  LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
  size_t free_b = 0, total_b = 0;
  LEASEHOLD_CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
  cudaDeviceProp prop{};
  LEASEHOLD_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  return DeviceMemory{free_b, total_b, prop.name, uuid_text(prop.uuid)};
}

int cuda_visible_devices() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // no driver or no device: not an error for "auto"
    return 0;
  }
  return n;
}

}  // namespace leasehold::detail
