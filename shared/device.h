// The device layer: the only code that differs between the host and CUDA
// backends. The coordinator creates one DevicePool per device it serves at
// start; each agent maps its device's once through a PoolMapping.
// Everything above works on offsets.
//
// Thread safety: objects are not shared between threads without external
// locking; the free functions are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace leasehold {

enum class Backend { Host, Cuda };

const char* backend_name(Backend b);
// "host" / "cuda"; nullopt for anything else ("auto" is resolved by
// resolve_backend).
std::optional<Backend> parse_backend(std::string_view text);
// "auto" → cuda when this build has CUDA and a device is visible, else host.
// Throws std::runtime_error when "cuda" is asked for but not available.
Backend resolve_backend(std::string_view text);

// True when this binary was built with the CUDA backend.
bool cuda_built();
// Visible CUDA devices; 0 when none or when built without CUDA.
int cuda_device_count();
// This process's ordinal of the GPU whose UUID is `uuid` ("GPU-8d6c..."):
// what another process calls device 1 may be this one's 0
// (CUDA_VISIBLE_DEVICES). -1 when no visible GPU has it.
int cuda_ordinal_of(std::string_view uuid);

struct DeviceMemory {
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
  std::string name;  // "NVIDIA H100 80GB HBM3", "host shared memory"
  // "GPU-8d6c...", as nvidia-smi and DCGM's exporter write it; empty on host.
  std::string uuid;
};
// Free and total memory of the device: cudaMemGetInfo on cuda; on host, the
// smaller of MemAvailable and the free space of /dev/shm.
DeviceMemory query_device_memory(Backend backend, int device);

// Everything needed to map a pool from another process.
struct PoolDescriptor {
  Backend backend = Backend::Host;
  int device = 0;
  std::string device_name;
  uint64_t size = 0;
  uint64_t alignment = 0;
  std::vector<uint8_t> handle;  // cudaIpcMemHandle_t bytes, or the segment name
  uint64_t epoch = 0;           // random per pool; tells pools apart
  // The GPU's UUID ("GPU-8d6c..."); "host-N" for the host backend's segment N.
  std::string uuid;
};

// The pool, owned by the coordinator. Allocated in the constructor of the
// backend, freed in the destructor (which never throws).
class DevicePool {
 public:
  virtual ~DevicePool() = default;
  const PoolDescriptor& descriptor() const { return desc_; }

 protected:
  PoolDescriptor desc_;
};

// Allocates a pool of `size` bytes on `device`. `name` makes the host
// segment's name unique per coordinator (derive it from the endpoint) so that
// a stale segment left by a crashed coordinator is found and replaced.
// Throws std::runtime_error naming the size and the backend on failure.
std::unique_ptr<DevicePool> create_pool(Backend backend, int device, uint64_t size,
                                        uint64_t alignment, std::string_view name);

// A pool mapped into this process (agent side).
class PoolMapping {
 public:
  virtual ~PoolMapping() = default;
  const PoolDescriptor& descriptor() const { return desc_; }
  // Base address: a device pointer on cuda, a host pointer on host.
  std::byte* base() const { return base_; }

 protected:
  PoolDescriptor desc_;
  std::byte* base_ = nullptr;
};

// Maps the pool that `desc` describes. Throws std::runtime_error naming the
// pool and the reason when it cannot (segment gone, IPC handle refused,
// backend not built).
std::unique_ptr<PoolMapping> map_pool(const PoolDescriptor& desc);

}  // namespace leasehold
