// CUDA backend: the pool is chunks of physical memory (the CUDA virtual
// memory API), each shared as a POSIX file descriptor; a process maps the
// chunks it was granted into a range it reserved for the whole pool. Only
// built when the CUDA toolkit is found.
#include <fcntl.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <cstdio>
#include <optional>
#include <cstring>
#include <stdexcept>

#include "shared/cuda_check.h"
#include "shared/cuda_vmm.h"
#include "shared/detail/backends.h"
#include "shared/units.h"

namespace leasehold::detail {

std::string uuid_text(const cudaUUID_t& uuid);

namespace {

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

CUmemAllocationProp chunk_properties(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  return prop;
}

// The chunks: physical memory made once at start (cuMemCreate), each
// exported as a POSIX file descriptor ahead (exporting costs most of a
// millisecond: never on a grant's path).
class CudaPool final : public DevicePool {
 public:
  CudaPool(int device, uint64_t size, uint64_t alignment) : device_(device), alignment_(alignment) {
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
    LEASEHOLD_CUDA_CHECK(cudaFree(nullptr));  // the primary context, for the driver calls
    const uint64_t chunks = size / alignment;
    reserve_descriptors(chunks, "a CUDA pool of " + format_bytes(size) + " in chunks of " +
                                    format_bytes(alignment));
    handles_.reserve(chunks);
    chunk_fds_.reserve(chunks);
    try {
      for (uint64_t i = 0; i < chunks; ++i) {
        handles_.push_back(0);
        chunk_fds_.emplace_back();
        make_chunk(i, " of a " + format_bytes(size) + " pool");
      }
      cudaDeviceProp dev{};
      LEASEHOLD_CUDA_CHECK(cudaGetDeviceProperties(&dev, device));
      desc_.backend = Backend::Cuda;
      desc_.device = device;
      desc_.device_name = dev.name;
      desc_.size = size;
      desc_.alignment = alignment;
      desc_.epoch = random_epoch();
      desc_.uuid = uuid_text(dev.uuid);
    } catch (...) {
      release();
      throw;
    }
  }
  ~CudaPool() override { release(); }

 protected:
  // New physical memory: the old handle released (its memory is freed
  // unless some process kept it mapped or imported), a new one made and
  // exported.
  void renew_chunk(uint64_t i) override {
    DeviceSwitch on(device_);
    chunk_fds_[i].reset();
    if (handles_[i] != 0) {
      if (CUresult r = cuda_vmm().mem_release(handles_[i]); r != CUDA_SUCCESS) {
        spdlog::error("{} on device {}", vmm_error("cuMemRelease", r), device_);
      }
      handles_[i] = 0;
    }
    make_chunk(i, " (renewing it)");
    on.restore();
  }

 private:
  // Makes chunk i's memory and descriptor (handles_[i], chunk_fds_[i]).
  // Throws naming the chunk and `what`, and the device's free memory.
  void make_chunk(uint64_t i, const std::string& what) {
    const CudaVmm& vmm = cuda_vmm();
    const CUmemAllocationProp prop = chunk_properties(device_);
    CUmemGenericAllocationHandle h{};
    if (CUresult r = vmm.mem_create(&h, alignment_, &prop, 0); r != CUDA_SUCCESS) {
      size_t free_b = 0, total_b = 0;
      cleared(cudaMemGetInfo(&free_b, &total_b));
      throw std::runtime_error(vmm_error("cuMemCreate", r) + " for chunk " + std::to_string(i) +
                               what + " on device " + std::to_string(device_) + " (free " +
                               format_bytes(free_b) + " of " + format_bytes(total_b) + ")");
    }
    handles_[i] = h;
    int fd = -1;
    if (CUresult r = vmm.export_handle(&fd, h, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        r != CUDA_SUCCESS) {
      throw std::runtime_error(vmm_error("cuMemExportToShareableHandle", r) + " for chunk " +
                               std::to_string(i) + " on device " + std::to_string(device_));
    }
    chunk_fds_[i] = UniqueFd(fd);
    // Not inherited by what the coordinator starts (the MPS daemon).
    ::fcntl(fd, F_SETFD, FD_CLOEXEC);
  }

  // Never throws; tolerates the driver being gone at process exit.
  void release() noexcept {
    chunk_fds_.clear();
    for (CUmemGenericAllocationHandle h : handles_) {
      if (h == 0) continue;
      if (CUresult r = cuda_vmm().mem_release(h);
          r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
        spdlog::error("{} on device {}", vmm_error("cuMemRelease", r), device_);
      }
    }
    handles_.clear();
  }

  int device_;
  uint64_t alignment_;  // the chunk size
  std::vector<CUmemGenericAllocationHandle> handles_;  // 0: none (a renewal failed)
};

// The pool's range reserved on the pool's device; chunks imported from
// their descriptors and mapped into it. The calling thread's current
// device is the same afterwards, whatever happens.
class CudaMapping final : public PoolMapping {
 public:
  explicit CudaMapping(const PoolDescriptor& desc) {
    const CudaVmm& vmm = cuda_vmm();
    DeviceSwitch on(desc.device);
    LEASEHOLD_CUDA_CHECK(cleared(cudaFree(nullptr)));  // the primary context
    CUdeviceptr ptr = 0;
    if (CUresult r = vmm.address_reserve(&ptr, desc.size, desc.alignment, 0, 0);
        r != CUDA_SUCCESS) {
      throw std::runtime_error("cannot reserve " + format_bytes(desc.size) +
                               " of address space for the pool on device " +
                               std::to_string(desc.device) + ": " +
                               vmm_error("cuMemAddressReserve", r));
    }
    on.restore();
    desc_ = desc;
    base_ = reinterpret_cast<std::byte*>(ptr);
  }
  ~CudaMapping() override {
    unmap_all();
    CUresult r = cuda_vmm().address_free(address(0), desc_.size);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
      spdlog::warn("{}", vmm_error("cuMemAddressFree", r));
    }
  }

 protected:
  void map_chunks(uint64_t first, const std::vector<int>& fds, Access access) override {
    const CudaVmm& vmm = cuda_vmm();
    DeviceSwitch on(desc_.device);
    uint64_t mapped = 0;
    try {
      for (; mapped < fds.size(); ++mapped) {
        const uint64_t i = first + mapped;
        CUmemGenericAllocationHandle h{};
        if (CUresult r = vmm.import_handle(
                &h, reinterpret_cast<void*>(static_cast<intptr_t>(fds[mapped])),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
            r != CUDA_SUCCESS) {
          throw std::runtime_error("cannot import chunk " + std::to_string(i) + ": " +
                                   vmm_error("cuMemImportFromShareableHandle", r));
        }
        // The mapping keeps the memory; the handle is not needed past it.
        CUresult r = vmm.map(address(i), desc_.alignment, 0, h, 0);
        vmm.mem_release(h);
        if (r != CUDA_SUCCESS) {
          throw std::runtime_error("cannot map chunk " + std::to_string(i) + ": " +
                                   vmm_error("cuMemMap", r));
        }
      }
      // One access change for the whole run.
      set_access(first, fds.size(), access);
    } catch (...) {
      if (mapped) unmap_chunks(first, mapped);
      throw;
    }
    on.restore();
  }
  void protect_chunk(uint64_t i, Access access) override {
    DeviceSwitch on(desc_.device);
    set_access(i, 1, access);
    on.restore();
  }
  void unmap_chunks(uint64_t first, uint64_t count) noexcept override {
    // Called from destructors on any thread: the pool's device current
    // while it runs, and never a throw.
    std::optional<DeviceSwitch> on;
    try {
      on.emplace(desc_.device);
    } catch (const std::exception& e) {
      spdlog::warn("unmapping chunks {}+{}: {}", first, count, e.what());
    }
    const CudaVmm& vmm = cuda_vmm();
    CUresult r = vmm.unmap(address(first), count * desc_.alignment);
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_DEINITIALIZED) return;
    // A run the driver will not unmap at once: chunk by chunk.
    for (uint64_t i = first; i < first + count; ++i) {
      r = vmm.unmap(address(i), desc_.alignment);
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
        spdlog::error("chunk {}: {}", i, vmm_error("cuMemUnmap", r));
      }
    }
  }

 private:
  void set_access(uint64_t first, uint64_t count, Access access) {
    CUmemAccessDesc a{};
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = desc_.device;
    a.flags = access == Access::ReadWrite ? CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                                          : CU_MEM_ACCESS_FLAGS_PROT_READ;
    CUresult r = cuda_vmm().set_access(address(first), count * desc_.alignment, &a, 1);
    if (r != CUDA_SUCCESS && access == Access::ReadOnly) {
      // A driver or GPU that cannot map device memory read-only: readable
      // and writable then, said once (read-only regions are not enforced
      // on it).
      a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      if (cuda_vmm().set_access(address(first), count * desc_.alignment, &a, 1) == CUDA_SUCCESS) {
        static std::atomic<bool> said{false};
        if (!said.exchange(true)) {
          spdlog::warn("device {} cannot map memory read-only ({}): regions are mapped "
                       "read-write for every attacher on it",
                       desc_.device, vmm_error("cuMemSetAccess", r));
        }
        return;
      }
    }
    if (r != CUDA_SUCCESS) {
      throw std::runtime_error("cannot make chunks " + std::to_string(first) + "+" +
                               std::to_string(count) + " " + access_name(access) + " on device " +
                               std::to_string(desc_.device) + ": " +
                               vmm_error("cuMemSetAccess", r));
    }
  }
  CUdeviceptr address(uint64_t i) const {
    return reinterpret_cast<CUdeviceptr>(base_) + i * desc_.alignment;
  }
};

// A window's pages show chunks by mapping the physical memory behind the
// chunk's address in the pool range (cuMemRetainAllocationHandle) once more
// at the page: no descriptor, no import, the same memory.
class CudaWindow final : public ChunkWindow {
 public:
  CudaWindow(std::shared_ptr<PoolMapping> source, std::byte* base, uint64_t pages,
             uint64_t page_size)
      : ChunkWindow(std::move(source), base, pages, page_size),
        device_(source_->descriptor().device) {}
  ~CudaWindow() override {
    hide_all();
    CUresult r = cuda_vmm().address_free(reinterpret_cast<CUdeviceptr>(base()),
                                         page_count() * page_size());
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
      spdlog::warn("{}", vmm_error("cuMemAddressFree", r));
    }
  }

 protected:
  void show_pages(uint64_t first, const std::vector<std::byte*>& sources) override {
    const CudaVmm& vmm = cuda_vmm();
    DeviceSwitch on(device_);
    uint64_t mapped = 0;
    try {
      for (; mapped < sources.size(); ++mapped) {
        CUmemGenericAllocationHandle h{};
        if (CUresult r = vmm.retain_handle(&h, sources[mapped]); r != CUDA_SUCCESS) {
          throw std::runtime_error("cannot show a chunk in a window: " +
                                   vmm_error("cuMemRetainAllocationHandle", r));
        }
        CUresult r = vmm.map(address(first + mapped), page_size(), 0, h, 0);
        vmm.mem_release(h);  // the mapping keeps the memory
        if (r != CUDA_SUCCESS) {
          throw std::runtime_error("cannot show a chunk at page " + std::to_string(first + mapped) +
                                   " of a window: " + vmm_error("cuMemMap", r));
        }
      }
      CUmemAccessDesc a{};
      a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
      a.location.id = device_;
      a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
      if (CUresult r = vmm.set_access(address(first), sources.size() * page_size(), &a, 1);
          r != CUDA_SUCCESS) {
        throw std::runtime_error("cannot make window pages " + std::to_string(first) + "+" +
                                 std::to_string(sources.size()) + " read-write: " +
                                 vmm_error("cuMemSetAccess", r));
      }
    } catch (...) {
      if (mapped && !hide_pages(first, mapped).empty()) {
        spdlog::error("a window's pages {}+{} may stay mapped", first, mapped);
      }
      throw;
    }
    try {
      on.restore();
    } catch (...) {  // the pages are mapped but the call fails: not shown
      hide_pages(first, sources.size());
      throw;
    }
  }
  std::vector<uint64_t> hide_pages(uint64_t first, uint64_t count) noexcept override {
    std::optional<DeviceSwitch> on;
    try {
      on.emplace(device_);
    } catch (const std::exception& e) {
      spdlog::warn("hiding window pages {}+{}: {}", first, count, e.what());
    }
    const CudaVmm& vmm = cuda_vmm();
    CUresult r = vmm.unmap(address(first), count * page_size());
    if (r == CUDA_SUCCESS || r == CUDA_ERROR_DEINITIALIZED) return {};
    std::vector<uint64_t> stuck;
    for (uint64_t p = first; p < first + count; ++p) {  // page by page, as the pool's unmap
      r = vmm.unmap(address(p), page_size());
      if (r != CUDA_SUCCESS && r != CUDA_ERROR_DEINITIALIZED) {
        spdlog::error("window page {}: {}", p, vmm_error("cuMemUnmap", r));
        stuck.push_back(p);
      }
    }
    return stuck;
  }

 private:
  CUdeviceptr address(uint64_t p) const { return reinterpret_cast<CUdeviceptr>(page(p)); }
  int device_;
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

uint64_t cuda_granularity(int device) {
  const CUmemAllocationProp prop = chunk_properties(device);
  size_t g = 0;
  if (CUresult r = cuda_vmm().granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
      r != CUDA_SUCCESS || g == 0) {
    throw std::runtime_error("cannot read the mapping granularity of device " +
                             std::to_string(device) + ": " +
                             vmm_error("cuMemGetAllocationGranularity", r));
  }
  return g;
}

std::unique_ptr<DevicePool> create_cuda_pool(int device, uint64_t size, uint64_t alignment) {
  return std::make_unique<CudaPool>(device, size, alignment);
}

std::unique_ptr<PoolMapping> map_cuda_pool(const PoolDescriptor& desc) {
  return std::make_unique<CudaMapping>(desc);
}

std::unique_ptr<ChunkWindow> open_cuda_window(std::shared_ptr<PoolMapping> source, uint64_t pages) {
  const PoolDescriptor& desc = source->descriptor();
  if (pages > UINT64_MAX / desc.alignment) {
    throw std::invalid_argument("a window past the address space");
  }
  const CudaVmm& vmm = cuda_vmm();
  DeviceSwitch on(desc.device);
  CUdeviceptr ptr = 0;
  if (CUresult r = vmm.address_reserve(&ptr, pages * desc.alignment, desc.alignment, 0, 0);
      r != CUDA_SUCCESS) {
    throw std::runtime_error("cannot reserve " + format_bytes(pages * desc.alignment) +
                             " of address space for a chunk window on device " +
                             std::to_string(desc.device) + ": " +
                             vmm_error("cuMemAddressReserve", r));
  }
  on.restore();
  return std::make_unique<CudaWindow>(std::move(source), reinterpret_cast<std::byte*>(ptr), pages,
                                      desc.alignment);
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
