#include "agent/spill/transfer.h"

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "shared/units.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "agent/engine/cuda_context.h"
#include "shared/cuda_check.h"
#endif

namespace leasehold::spill {
namespace {

constexpr size_t kPageBytes = 4096;

// Host backend: "device" memory is host memory, so a copy is a memcpy that
// has finished when it returns, and every fence is done from the start.
class DoneFence final : public Fence {
 public:
  bool done() override { return true; }
  void wait() override {}
};

class HostTransfer final : public Transfer {
 public:
  HostTransfer() : done_(std::make_shared<DoneFence>()) {}

  engine::Device device() const override { return engine::Device::cpu(); }
  void to_host(void* host, const void* device_src, size_t bytes) override {
    copy(host, device_src, bytes);
  }
  void to_device(void* device_dst, const void* host, size_t bytes) override {
    copy(device_dst, host, bytes);
  }
  // One shared fence: marking costs no allocation.
  std::shared_ptr<Fence> mark() override { return done_; }
  void compute_waits(const std::shared_ptr<Fence>&) override {}
  double busy_seconds() override { return static_cast<double>(busy_ns_.load()) * 1e-9; }

 private:
  void copy(void* dst, const void* src, size_t bytes) {
    if (bytes == 0) return;
    auto start = std::chrono::steady_clock::now();
    std::memcpy(dst, src, bytes);
    auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                  std::chrono::steady_clock::now() - start)
                  .count();
    busy_ns_.fetch_add(ns);
  }

  std::shared_ptr<DoneFence> done_;
  std::atomic<int64_t> busy_ns_{0};
};

#ifdef LEASEHOLD_HAVE_CUDA

// Makes `device` current for the scope and restores the caller's device:
// the transfer must not change which device the job thread's own calls use.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    LEASEHOLD_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    // Restoring cannot fail for a device that was current a moment ago;
    // a destructor must not throw anyway.
    if (changed_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Events are created once and reused: cudaEventCreate can be slow and the
// store marks a fence per chunk. Fences return their event here when the last
// holder (possibly an I/O thread) drops them, hence the mutex and the shared
// ownership: a fence may outlive the transfer that made it.
class EventPool {
 public:
  EventPool(int device, unsigned flags) : device_(device), flags_(flags) {}
  ~EventPool() {
    // Errors are ignored: the runtime may already be unloading at exit.
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;

  // REQUIRES: the pool's device is current.
  cudaEvent_t take() {
    {
      std::lock_guard lock(mu_);
      if (!free_.empty()) {
        cudaEvent_t e = free_.back();
        free_.pop_back();
        return e;
      }
    }
    cudaEvent_t e = nullptr;
    LEASEHOLD_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags_));
    return e;
  }
  void give(cudaEvent_t e) noexcept {
    std::lock_guard lock(mu_);
    try {
      free_.push_back(e);
    } catch (...) {
      cudaEventDestroy(e);  // out of memory: drop the event rather than leak it
    }
  }
  int device() const { return device_; }

 private:
  int device_;
  unsigned flags_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

class CudaFence final : public Fence {
 public:
  CudaFence(std::shared_ptr<EventPool> pool, cudaEvent_t event)
      : pool_(std::move(pool)), event_(event) {}
  ~CudaFence() override { pool_->give(event_); }

  // The spill file's I/O threads wait on fences too: with the event's
  // device current, so they never touch (and create a context on) device 0.
  bool done() override {
    DeviceGuard guard(pool_->device());
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    throw CudaError(err, "cudaEventQuery(fence)", __FILE__, __LINE__);
  }
  void wait() override {
    DeviceGuard guard(pool_->device());
    LEASEHOLD_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  cudaEvent_t event() const { return event_; }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t event_;
};

class CudaTransfer final : public Transfer {
 public:
  explicit CudaTransfer(engine::Device device)
      : device_(device),
        sync_events_(std::make_shared<EventPool>(device.index, cudaEventDisableTiming)),
        timing_events_(std::make_shared<EventPool>(device.index, cudaEventDefault)) {
    DeviceGuard guard(device_.index);
    // Non-blocking: the copy stream must not synchronize with the legacy
    // default stream, or copies would serialize with unrelated work.
    LEASEHOLD_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaTransfer() override {
    // Copies still queued read or write memory the caller owns: finish them
    // before the stream goes. Errors are ignored (a destructor, and a device
    // fault has been reported to whoever waited on a fence).
    cudaStreamSynchronize(stream_);
    for (auto& t : timings_) {
      timing_events_->give(t.start);
      timing_events_->give(t.end);
    }
    cudaStreamDestroy(stream_);
  }

  engine::Device device() const override { return device_; }

  void to_host(void* host, const void* device_src, size_t bytes) override {
    copy(host, device_src, bytes, cudaMemcpyDeviceToHost);
  }
  void to_device(void* device_dst, const void* host, size_t bytes) override {
    copy(device_dst, host, bytes, cudaMemcpyHostToDevice);
  }

  std::shared_ptr<Fence> mark() override {
    DeviceGuard guard(device_.index);
    cudaEvent_t e = sync_events_->take();
    std::shared_ptr<CudaFence> fence;
    try {
      fence = std::make_shared<CudaFence>(sync_events_, e);  // owns e from here
    } catch (...) {
      sync_events_->give(e);
      throw;
    }
    LEASEHOLD_CUDA_CHECK(cudaEventRecord(e, stream_));
    return fence;
  }

  void compute_waits(const std::shared_ptr<Fence>& f) override {
    auto* fence = dynamic_cast<CudaFence*>(f.get());
    if (!fence) throw std::invalid_argument("compute_waits: not a fence of this CUDA transfer");
    DeviceGuard guard(device_.index);
    LEASEHOLD_CUDA_CHECK(
        cudaStreamWaitEvent(engine::compute_stream(device_.index), fence->event(), 0));
  }

  double busy_seconds() override {
    collect_timings();
    return busy_seconds_;
  }

 private:
  struct Timing {
    cudaEvent_t start;
    cudaEvent_t end;
  };

  void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return;
    DeviceGuard guard(device_.index);
    // Order the copy after the work the calling thread already queued: the
    // kernels that produce the bytes (to_host) or still read the memory
    // being overwritten (to_device). The wait is captured when it is queued,
    // so the event can go back to the pool at once.
    cudaEvent_t after = sync_events_->take();
    try {
      LEASEHOLD_CUDA_CHECK(cudaEventRecord(after, engine::compute_stream(device_.index)));
      LEASEHOLD_CUDA_CHECK(cudaStreamWaitEvent(stream_, after, 0));
    } catch (...) {
      sync_events_->give(after);
      throw;
    }
    sync_events_->give(after);

    collect_timings();
    // The start event runs once the wait above is satisfied, so the interval
    // measures the copy and not the compute work it waited for.
    Timing t{timing_events_->take(), nullptr};
    try {
      t.end = timing_events_->take();
      LEASEHOLD_CUDA_CHECK(cudaEventRecord(t.start, stream_));
      LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream_));
      LEASEHOLD_CUDA_CHECK(cudaEventRecord(t.end, stream_));
      timings_.push_back(t);
    } catch (...) {
      timing_events_->give(t.start);
      if (t.end) timing_events_->give(t.end);
      throw;
    }
  }

  // Adds the copies that have completed, oldest first, without blocking.
  // Copies on one stream run one after the other, so the intervals do not
  // overlap and their sum is the time the copy engine was busy for us.
  void collect_timings() {
    while (!timings_.empty()) {
      Timing t = timings_.front();
      cudaError_t err = cudaEventQuery(t.end);
      if (err == cudaErrorNotReady) return;
      if (err != cudaSuccess)
        throw CudaError(err, "cudaEventQuery(copy timing)", __FILE__, __LINE__);
      float ms = 0;
      LEASEHOLD_CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.end));
      busy_seconds_ += static_cast<double>(ms) * 1e-3;
      timings_.pop_front();
      timing_events_->give(t.start);
      timing_events_->give(t.end);
    }
  }

  engine::Device device_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<EventPool> sync_events_;
  std::shared_ptr<EventPool> timing_events_;
  std::deque<Timing> timings_;
  double busy_seconds_ = 0;
};

#endif  // LEASEHOLD_HAVE_CUDA

}  // namespace

std::unique_ptr<Transfer> make_transfer(engine::Device device) {
  if (!device.is_cuda()) return std::make_unique<HostTransfer>();
#ifdef LEASEHOLD_HAVE_CUDA
  return std::make_unique<CudaTransfer>(device);
#else
  throw std::invalid_argument("spill transfer for " + device.str() + " in a build without CUDA");
#endif
}

PinnedBuffer::PinnedBuffer(size_t bytes, engine::Device device) {
  if (bytes == 0) return;
  if (device.is_cuda()) {
#ifdef LEASEHOLD_HAVE_CUDA
    DeviceGuard guard(device.index);
    void* p = nullptr;
    cudaError_t err = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
    if (err != cudaSuccess) {
      throw std::runtime_error("cannot allocate " + format_bytes(bytes) + " (" +
                               std::to_string(bytes) + " bytes) of pinned host memory for " +
                               device.str() + ": " + cudaGetErrorString(err));
    }
    data_ = static_cast<char*>(p);
    cuda_ = true;
#else
    throw std::invalid_argument("pinned buffer for " + device.str() + " in a build without CUDA");
#endif
  } else {
    // aligned_alloc wants a size that is a multiple of the alignment.
    uint64_t rounded = align_up(bytes, kPageBytes);
    void* p = rounded ? std::aligned_alloc(kPageBytes, rounded) : nullptr;
    if (!p) {
      throw std::runtime_error("cannot allocate " + format_bytes(bytes) + " (" +
                               std::to_string(bytes) + " bytes) of host memory for spilling");
    }
    data_ = static_cast<char*>(p);
  }
  size_ = bytes;
}

PinnedBuffer::~PinnedBuffer() { reset(); }

PinnedBuffer::PinnedBuffer(PinnedBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      cuda_(std::exchange(o.cuda_, false)) {}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    cuda_ = std::exchange(o.cuda_, false);
  }
  return *this;
}

void PinnedBuffer::reset() noexcept {
  if (!data_) return;
#ifdef LEASEHOLD_HAVE_CUDA
  // cudaFreeHost fails only for a pointer it did not allocate or when the
  // runtime is already unloading at exit; neither is worth a throw here.
  if (cuda_) cudaFreeHost(data_);
#endif
  if (!cuda_) std::free(data_);
  data_ = nullptr;
  size_ = 0;
  cuda_ = false;
}

}  // namespace leasehold::spill
