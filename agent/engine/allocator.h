// Where tensor memory comes from. Every Storage holds the allocator that made
// it, so an allocator lives as long as any of its memory does.
//
// Allocators are chosen per device: a thread may install its own (the agent
// installs its lease-local allocator while it runs a job) with
// AllocatorGuard; otherwise CPU memory comes from malloc and CUDA memory from
// cudaMallocAsync on the thread's compute stream.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "agent/engine/dtype.h"

namespace leasehold::engine {

struct AllocatorStats {
  uint64_t in_use_bytes = 0;       // handed out and not yet returned
  uint64_t peak_in_use_bytes = 0;
  uint64_t cached_bytes = 0;       // held for reuse but not in use
  uint64_t allocations = 0;        // calls to allocate() so far
  uint64_t leases = 0;             // coordinator leases held (lease allocators)
  uint64_t peak_leased_bytes = 0;  // most bytes leased at once (lease allocators)
  uint64_t pages_mapped = 0;       // pages shown in its window so far (lease allocators)
  uint64_t trims = 0;              // times idle pages were hidden, each after a fence (same)
};

// Thrown when an allocation cannot be served; the message names the sizes.
// `permanent`: no memory freed elsewhere would make it fit (one tensor
// larger than the whole budget or pool), so nothing is spilled for it.
class OutOfMemoryError : public std::runtime_error {
 public:
  OutOfMemoryError(const std::string& what, uint64_t requested, bool permanent = false)
      : std::runtime_error(what), requested_(requested), permanent_(permanent) {}
  uint64_t requested() const { return requested_; }
  bool permanent() const { return permanent_; }

 private:
  uint64_t requested_;
  bool permanent_;
};

// Frees memory for an allocation that would not fit the allocator's
// budget: called with the bytes needed, returns how many bytes it freed (0:
// it can free nothing more). The spill manager moves cold saved tensors out
// of the device this way. Called on the allocating thread, without the
// allocator's lock held, so it may free memory of the same allocator.
using Reclaimer = std::function<uint64_t(uint64_t bytes)>;

class Allocator {
 public:
  virtual ~Allocator() = default;
  // Returns memory for `bytes` (> 0), aligned to at least 256 bytes. Throws
  // OutOfMemoryError. Thread-safe.
  virtual void* allocate(size_t bytes) = 0;
  // Returns memory from allocate() with the same size. Never throws.
  virtual void deallocate(void* ptr, size_t bytes) noexcept = 0;
  virtual Device device() const = 0;
  virtual AllocatorStats stats() const = 0;
  // Memory for `bytes` only if it is free now, without new leases, without
  // giving memory back and without the reclaimer (a prefetch must not make
  // room); nullptr otherwise. The default never finds any.
  virtual void* allocate_if_free(size_t /*bytes*/) { return nullptr; }
  // Installs the reclaimer asked before an allocation fails (empty: none).
  // Allocators without a budget never need one and ignore it.
  virtual void set_reclaimer(Reclaimer) {}
  // Installs what frees memory held only to go faster (a CUDA graph's arena
  // between its launches, graphed_steps.h), asked before the reclaimer: an
  // idle arena is given up before a saved tensor is moved off the device.
  // Same rules as the reclaimer; allocators without a budget ignore it.
  virtual void set_idle_release(Reclaimer) {}
  // Before an allocation of `bytes` that should reuse the memory this
  // allocator holds free rather than add to it (a CUDA graph's arena, laid
  // out after the step it replaces ran op by op): makes enough of that
  // memory available where the allocation will land, unless it already
  // is. May wait for the device. The default does nothing.
  virtual void reuse_idle(size_t /*bytes*/) {}
  // Most bytes this allocator may hold at once; 0: no budget of its own.
  virtual uint64_t budget() const { return 0; }
};

std::shared_ptr<Allocator> cpu_allocator();
#ifdef LEASEHOLD_HAVE_CUDA
std::shared_ptr<Allocator> cuda_allocator(int device);
// Page-locked host memory (cudaHostAlloc), a CPU device's: every GPU reads
// and writes it directly at the same address (unified addressing), over
// the host link. For state a kernel touches once a step that a device's
// memory cannot spare (an optimizer's, optim.h). Allocating pins pages and
// may take milliseconds; freeing waits for the device. This thread's: the
// one a PinnedHostGuard installed, else cudaHostAlloc's.
std::shared_ptr<Allocator> pinned_host_allocator();
#endif

// Installs `alloc` (page-locked host memory, a CPU device's) as
// pinned_host_allocator() on this thread until destroyed: a job's host
// tier (agent/spill/host_tier.h), so that what its step keeps in host
// memory by plan (host_offload.h, optim.h) counts in the tier the operator
// set and stops at its room, where cudaHostAlloc's would pin more.
class PinnedHostGuard {
 public:
  explicit PinnedHostGuard(std::shared_ptr<Allocator> alloc);
  ~PinnedHostGuard();
  PinnedHostGuard(const PinnedHostGuard&) = delete;
  PinnedHostGuard& operator=(const PinnedHostGuard&) = delete;

 private:
  std::shared_ptr<Allocator> previous_;
};

// The allocator new tensors on `device` get on this thread.
std::shared_ptr<Allocator> current_allocator(Device device);

// Installs `alloc` for its device on this thread until destroyed.
class AllocatorGuard {
 public:
  explicit AllocatorGuard(std::shared_ptr<Allocator> alloc);
  ~AllocatorGuard();
  AllocatorGuard(const AllocatorGuard&) = delete;
  AllocatorGuard& operator=(const AllocatorGuard&) = delete;

 private:
  DeviceType type_;
  std::shared_ptr<Allocator> previous_;
};

// While one lives on this thread, memory that Storage frees here goes back
// to its allocator only when the guard ends, except memory of `exempt`. A
// CUDA graph's capture holds one: its work is recorded, not run, so
// memory freed during the capture may still be read when the graph runs,
// and a stream-ordered free would be captured as well. Memory of the
// graph's own pool (`exempt`) is reused within the capture, which is safe
// because the graph runs its work in the order it was captured.
class DeferFreesGuard {
 public:
  explicit DeferFreesGuard(const Allocator* exempt);
  // Frees what was deferred.
  ~DeferFreesGuard();
  // False when a free could not be deferred (no memory for the list) and
  // was made at once: the capture must be abandoned.
  bool all_deferred() const { return all_deferred_; }
  DeferFreesGuard(const DeferFreesGuard&) = delete;
  DeferFreesGuard& operator=(const DeferFreesGuard&) = delete;

 private:
  friend class Storage;
  struct Deferred {
    std::shared_ptr<Allocator> allocator;
    void* data;
    size_t bytes;
  };
  const Allocator* exempt_;
  std::vector<Deferred> deferred_;
  bool all_deferred_ = true;
  DeferFreesGuard* previous_;
};

// Reference-counted memory of one tensor or of several views of it.
class Storage {
 public:
  Storage(size_t bytes, std::shared_ptr<Allocator> allocator);
  // Storage of `bytes` from allocator->allocate_if_free(); null when there
  // is no such memory free now.
  static std::shared_ptr<Storage> if_free(size_t bytes, std::shared_ptr<Allocator> allocator);
  // Storage over `bytes` at `data` on `device` that it does not own (a
  // shared cache region): nothing is freed when it goes; `keepalive` (what
  // owns the memory) is held until then.
  static std::shared_ptr<Storage> borrowed(void* data, size_t bytes, Device device,
                                           std::shared_ptr<void> keepalive);
  ~Storage();
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  Device device() const { return allocator_->device(); }
  const std::shared_ptr<Allocator>& allocator() const { return allocator_; }

 private:
  Storage(void* adopted, size_t bytes, std::shared_ptr<Allocator> allocator)
      : data_(adopted), bytes_(bytes), allocator_(std::move(allocator)) {}
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::shared_ptr<Allocator> allocator_;
};

}  // namespace leasehold::engine
