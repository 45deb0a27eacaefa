#include "agent/engine/allocator.h"

#include <atomic>
#include <cstdlib>
#include <mutex>

#include <spdlog/spdlog.h>

#include "agent/engine/cuda_context.h"
#include "shared/units.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include "shared/cuda_check.h"
#endif

namespace leasehold::engine {
namespace {

// Counts bytes for the stats of the simple allocators.
class Counter {
 public:
  void add(uint64_t n) {
    uint64_t now = in_use_.fetch_add(n) + n;
    uint64_t peak = peak_.load();
    while (now > peak && !peak_.compare_exchange_weak(peak, now)) {
    }
    ++allocations_;
  }
  void sub(uint64_t n) { in_use_.fetch_sub(n); }
  AllocatorStats stats() const {
    AllocatorStats s;
    s.in_use_bytes = in_use_.load();
    s.peak_in_use_bytes = peak_.load();
    s.allocations = allocations_.load();
    return s;
  }

 private:
  std::atomic<uint64_t> in_use_{0}, peak_{0}, allocations_{0};
};

class CpuAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    void* p = std::aligned_alloc(256, align_up(bytes, 256));
    if (!p) {
      throw OutOfMemoryError("CPU allocation of " + format_bytes(bytes) + " failed", bytes);
    }
    counter_.add(bytes);
    return p;
  }
  void deallocate(void* p, size_t bytes) noexcept override {
    std::free(p);
    counter_.sub(bytes);
  }
  Device device() const override { return Device::cpu(); }
  AllocatorStats stats() const override { return counter_.stats(); }

 private:
  Counter counter_;
};

#ifdef LEASEHOLD_HAVE_CUDA
// Stream-ordered allocation on the allocating thread's compute stream: the
// driver's pool caches and reuses memory, so this is cheap after warm-up.
class CudaAllocator final : public Allocator {
 public:
  explicit CudaAllocator(int device) : device_(device) {}
  void* allocate(size_t bytes) override {
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(device_));
    void* p = nullptr;
    cudaError_t err = cudaMallocAsync(&p, bytes, compute_stream(device_));
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw OutOfMemoryError("CUDA allocation of " + format_bytes(bytes) + " on device " +
                                 std::to_string(device_) + " failed: " + cudaGetErrorString(err),
                             bytes);
    }
    counter_.add(bytes);
    return p;
  }
  void deallocate(void* p, size_t bytes) noexcept override {
    // Never throws; tolerates the runtime unloading at process exit.
    cudaError_t err = cudaSetDevice(device_);
    if (err == cudaSuccess) {
      try {
        err = cudaFreeAsync(p, compute_stream(device_));
      } catch (const std::exception& e) {
        spdlog::error("CUDA free on device {}: {}", device_, e.what());
      }
    }
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      spdlog::error("cudaFreeAsync of {} on device {} failed: {}", format_bytes(bytes), device_,
                    cudaGetErrorString(err));
    }
    counter_.sub(bytes);
  }
  Device device() const override { return Device::cuda(device_); }
  AllocatorStats stats() const override { return counter_.stats(); }

 private:
  int device_;
  Counter counter_;
};
#endif

#ifdef LEASEHOLD_HAVE_CUDA
class PinnedHostAllocator final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    void* p = nullptr;
    // (Portable: every device's context may use it, as unified addressing
    // lets each at this address.)
    cudaError_t err = cudaHostAlloc(&p, align_up(bytes, 256), cudaHostAllocPortable);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw OutOfMemoryError("page-locked host allocation of " + format_bytes(bytes) +
                                 " failed: " + cudaGetErrorString(err),
                             bytes);
    }
    counter_.add(bytes);
    return p;
  }
  void deallocate(void* p, size_t bytes) noexcept override {
    cudaError_t err = cudaFreeHost(p);
    if (err != cudaSuccess && err != cudaErrorCudartUnloading) {
      spdlog::error("cudaFreeHost of {} failed: {}", format_bytes(bytes),
                    cudaGetErrorString(err));
    }
    counter_.sub(bytes);
  }
  Device device() const override { return Device::cpu(); }
  AllocatorStats stats() const override { return counter_.stats(); }

 private:
  Counter counter_;
};
#endif

// Memory owned elsewhere (Storage::borrowed): allocates nothing, frees
// nothing, and keeps its owner alive.
class BorrowedMemory final : public Allocator {
 public:
  BorrowedMemory(Device device, std::shared_ptr<void> owner)
      : device_(device), owner_(std::move(owner)) {}
  void* allocate(size_t) override {
    throw std::logic_error("borrowed memory cannot allocate");
  }
  void deallocate(void*, size_t) noexcept override {}
  Device device() const override { return device_; }
  AllocatorStats stats() const override { return {}; }

 private:
  Device device_;
  std::shared_ptr<void> owner_;
};

thread_local std::shared_ptr<Allocator> t_cpu_override;
thread_local std::shared_ptr<Allocator> t_cuda_override;
thread_local std::shared_ptr<Allocator> t_pinned_override;  // PinnedHostGuard's
thread_local DeferFreesGuard* t_defer_frees = nullptr;

}  // namespace

std::shared_ptr<Allocator> cpu_allocator() {
  static auto a = std::make_shared<CpuAllocator>();
  return a;
}

#ifdef LEASEHOLD_HAVE_CUDA
std::shared_ptr<Allocator> cuda_allocator(int device) {
  static std::mutex mu;
  static std::shared_ptr<Allocator> per_device[64];
  if (device < 0 || device >= 64) throw std::invalid_argument("bad CUDA device index");
  std::lock_guard lock(mu);
  if (!per_device[device]) per_device[device] = std::make_shared<CudaAllocator>(device);
  return per_device[device];
}

std::shared_ptr<Allocator> pinned_host_allocator() {
  if (t_pinned_override) return t_pinned_override;
  static auto a = std::make_shared<PinnedHostAllocator>();
  return a;
}
#endif

PinnedHostGuard::PinnedHostGuard(std::shared_ptr<Allocator> alloc)
    : previous_(std::move(t_pinned_override)) {
  t_pinned_override = std::move(alloc);
}

PinnedHostGuard::~PinnedHostGuard() { t_pinned_override = std::move(previous_); }

std::shared_ptr<Allocator> current_allocator(Device device) {
  if (device.is_cuda()) {
    if (t_cuda_override && t_cuda_override->device() == device) return t_cuda_override;
#ifdef LEASEHOLD_HAVE_CUDA
    return cuda_allocator(device.index);
#else
    throw std::runtime_error("CUDA tensors need a build with CUDA support");
#endif
  }
  return t_cpu_override ? t_cpu_override : cpu_allocator();
}

AllocatorGuard::AllocatorGuard(std::shared_ptr<Allocator> alloc)
    : type_(alloc->device().type) {
  auto& slot = type_ == DeviceType::CUDA ? t_cuda_override : t_cpu_override;
  previous_ = slot;
  slot = std::move(alloc);
}

AllocatorGuard::~AllocatorGuard() {
  auto& slot = type_ == DeviceType::CUDA ? t_cuda_override : t_cpu_override;
  slot = std::move(previous_);
}

Storage::Storage(size_t bytes, std::shared_ptr<Allocator> allocator)
    : bytes_(bytes), allocator_(std::move(allocator)) {
  data_ = bytes_ ? allocator_->allocate(bytes_) : nullptr;
}

std::shared_ptr<Storage> Storage::if_free(size_t bytes, std::shared_ptr<Allocator> allocator) {
  if (bytes == 0) return nullptr;
  void* p = allocator->allocate_if_free(bytes);
  if (!p) return nullptr;
  return std::shared_ptr<Storage>(new Storage(p, bytes, std::move(allocator)));
}

std::shared_ptr<Storage> Storage::borrowed(void* data, size_t bytes, Device device,
                                           std::shared_ptr<void> keepalive) {
  return std::shared_ptr<Storage>(
      new Storage(data, bytes, std::make_shared<BorrowedMemory>(device, std::move(keepalive))));
}

DeferFreesGuard::DeferFreesGuard(const Allocator* exempt)
    : exempt_(exempt), previous_(t_defer_frees) {
  t_defer_frees = this;
}

DeferFreesGuard::~DeferFreesGuard() {
  t_defer_frees = previous_;
  for (Deferred& d : deferred_) d.allocator->deallocate(d.data, d.bytes);
}

Storage::~Storage() {
  if (!data_) return;
  if (DeferFreesGuard* defer = t_defer_frees; defer && allocator_.get() != defer->exempt_) {
    try {
      defer->deferred_.push_back({allocator_, data_, bytes_});
      return;
    } catch (const std::bad_alloc&) {
      defer->all_deferred_ = false;  // (freed now rather than leaked)
    }
  }
  allocator_->deallocate(data_, bytes_);
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::Float32: return "float32";
    case DType::Float64: return "float64";
    case DType::Int64: return "int64";
    case DType::BFloat16: return "bfloat16";
  }
  return "?";
}

std::string Device::str() const {
  return is_cuda() ? "cuda:" + std::to_string(index) : "cpu";
}

}  // namespace leasehold::engine
