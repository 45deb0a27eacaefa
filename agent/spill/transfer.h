// How spilled bytes move between the job's device memory and host memory.
// The CUDA transfer copies on a dedicated copy stream with events, so
// compute and copies overlap; the host transfer (host backend, where
// "device" memory is host memory) copies at once with memcpy.
//
// Ordering rules the spill store relies on:
//   - a copy started by to_host()/to_device() runs after all work the
//     calling thread had queued on its compute stream (it may read memory a
//     kernel is still writing, or write memory a kernel was still reading);
//   - a Fence marks the copies started so far; done()/wait() observe it
//     from the host, compute_waits() orders later compute work after it
//     without blocking the host.
//
// Thread safety: to_host/to_device/mark/compute_waits from the job's thread;
// done() and wait() from any thread.
#pragma once

#include <cstddef>
#include <memory>

#include "agent/engine/dtype.h"

namespace leasehold::spill {

class Fence {
 public:
  virtual ~Fence() = default;
  virtual bool done() = 0;
  // Blocks until done. Throws CudaError for a device fault.
  virtual void wait() = 0;
};

class Transfer {
 public:
  virtual ~Transfer() = default;
  virtual engine::Device device() const = 0;
  // Device → host and host → device copies (see the ordering rules above).
  // `host` must be pinned memory from a PinnedBuffer on the CUDA backend.
  virtual void to_host(void* host, const void* device_src, size_t bytes) = 0;
  virtual void to_device(void* device_dst, const void* host, size_t bytes) = 0;
  // A fence after the copies started so far.
  virtual std::shared_ptr<Fence> mark() = 0;
  // Later work the calling thread queues on its compute stream runs after `f`.
  virtual void compute_waits(const std::shared_ptr<Fence>& f) = 0;
  // Seconds the copies that have completed took, summed (for achieved
  // bandwidth: bytes copied / busy seconds). Never blocks.
  virtual double busy_seconds() = 0;
};

// The transfer for `device`: memcpy on the CPU, a copy stream on CUDA.
std::unique_ptr<Transfer> make_transfer(engine::Device device);

// Host memory allocated once (cudaHostAlloc, page-locked, on the CUDA
// backend; 4 KiB-aligned heap memory otherwise): allocating pinned memory
// synchronizes the device, so it never happens on the hot path. Always
// 4 KiB-aligned (O_DIRECT needs it).
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  // Throws std::runtime_error naming the size when the allocation fails.
  PinnedBuffer(size_t bytes, engine::Device device);
  ~PinnedBuffer();
  PinnedBuffer(PinnedBuffer&& o) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& o) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  char* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void reset() noexcept;
  char* data_ = nullptr;
  size_t size_ = 0;
  bool cuda_ = false;
};

}  // namespace leasehold::spill
