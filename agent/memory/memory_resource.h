// Where a job's device memory comes from, in RMM's shape: one resource that
// owns memory (paged_resource.h: leased pages shown in a window of addresses)
// and adaptors around it that each add one thing (resource_adaptors.h: the
// budget, the reclaimer, the statistics). The lease allocator
// (agent/lease_allocator.h) stacks them and is what the engine sees.
//
// Every allocation names the stream its memory is used on; a deallocation,
// the stream its last use was queued on (nullptr: not known). Before memory
// leaves the job (pages hidden, leases given back) the resource waits for
// the streams it was freed on; the engine's fence waits for the whole
// device, which covers its copy streams too. Memory freed is handed out
// again at once, on any stream: the engine queues all of a job's work in
// order on its thread's compute stream, and its copy streams order
// themselves against it with events (agent/spill).
#pragma once

#include <cstdint>

#include "agent/engine/allocator.h"
#include "shared/device.h"

namespace leasehold {

// A cudaStream_t on cuda; nullptr on host (and for the legacy stream).
using StreamRef = void*;

using engine::OutOfMemoryError;

// The engine device a pool's memory is on: cuda:N, or the CPU for a host pool.
inline engine::Device pool_device(const PoolDescriptor& pool) {
  return pool.backend == Backend::Cuda ? engine::Device::cuda(pool.device) : engine::Device::cpu();
}

class MemoryResource {
 public:
  virtual ~MemoryResource() = default;
  // Memory for `bytes` (> 0), aligned to at least 256 bytes. Throws
  // OutOfMemoryError naming the sizes and why. Thread-safe.
  virtual void* allocate(uint64_t bytes, StreamRef stream) = 0;
  // Returns memory from allocate() with the same size. Never throws.
  virtual void deallocate(void* p, uint64_t bytes, StreamRef stream) noexcept = 0;
  // Memory for `bytes` only if the resource has it now: no new lease, no
  // memory given back or hidden, nothing spilled (a prefetch must not make
  // room). nullptr otherwise.
  virtual void* allocate_if_free(uint64_t bytes, StreamRef stream) = 0;
};

}  // namespace leasehold
