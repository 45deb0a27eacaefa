// The agent's host tier as one job sees it: the bytes of a PinnedBuffer
// (page-locked host memory allocated once at agent start), up to the job's
// limit, shared by what the job spills there (tiered_store.h) and the
// page-locked tensors its step keeps in host memory by plan, the blocks'
// inputs (engine/host_offload.h) and the optimizer's state
// (engine/optim.h: move_state_to_host), through HostTierAllocator. So the
// job's page-locked host memory is the tier the operator configured
// (--spill-host-bytes, or the job's spill.host_bytes), never more: where
// the tier is full, a planned tensor stays on the device and a spill goes
// to the file.
//
// Thread safety: every method, from any thread.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/spill/transfer.h"
#include "shared/pool_allocator.h"

namespace leasehold::spill {

class HostTier {
 public:
  // [base, base + bytes) page-locked; at most `limit` bytes of it held at
  // once (0: all). REQUIRES: bytes >= `alignment`, a power of two.
  HostTier(char* base, uint64_t bytes, uint64_t limit, uint64_t alignment);

  // The offset of `bytes` (rounded up to the alignment) from `end`, or
  // nullopt when that would pass the limit or no free run is long enough.
  // Spills ask from the low end and planned tensors from the high one (a
  // preference: the best fit wins). REQUIRES: bytes > 0.
  std::optional<uint64_t> allocate(uint64_t bytes, PoolAllocator::End end);
  // REQUIRES: `offset` from allocate(), not freed since.
  void free(uint64_t offset);
  // Frees a spill's range whose copy off the device may still be queued
  // (`copies`, its fence; may be null or done): a spill may take it at
  // once, its own copy queued behind that one on the same copy stream, but
  // a planned tensor, written from the host or another stream, only once
  // the copy is done (wait_for_copies).
  void free_after(uint64_t offset, std::shared_ptr<Fence> copies);
  // Waits for the copies of every range freed by free_after() so far.
  // Throws what Fence::wait throws (a device fault).
  void wait_for_copies();

  char* data(uint64_t offset) const { return base_ + offset; }
  uint64_t limit() const { return limit_; }
  uint64_t used_bytes() const;
  uint64_t largest_free() const;

 private:
  char* base_;
  uint64_t limit_;
  mutable std::mutex mu_;
  PoolAllocator pool_;
  std::vector<std::shared_ptr<Fence>> copies_;  // free_after()'s not seen done yet
};

// Page-locked host tensors from a HostTier (the engine's allocator
// interface; the tensors are the host's, at pinned addresses every GPU
// reaches directly). An allocation first waits for spills' copies into
// ranges freed while they were queued (HostTier::free_after); one over the
// tier's room throws engine::OutOfMemoryError naming the tier. Freeing
// first waits for `device`'s queued work (as cudaFreeHost does), which may
// still read or write the bytes (the optimizer's update, a copy back),
// before a spill may take them; a wait that fails (the device's context
// lost) keeps them out of this job's tier rather than risk it (the agent
// cannot go on with that device anyway).
class HostTierAllocator final : public engine::Allocator {
 public:
  HostTierAllocator(std::shared_ptr<HostTier> tier, engine::Device device);
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) noexcept override;
  engine::Device device() const override { return engine::Device::cpu(); }
  engine::AllocatorStats stats() const override;

 private:
  std::shared_ptr<HostTier> tier_;
  engine::Device device_;  // whose work may read the memory
  mutable std::mutex mu_;
  engine::AllocatorStats stats_;
  bool lost_ = false;  // a wait for the device failed: said once
};

}  // namespace leasehold::spill
