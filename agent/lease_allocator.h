// The lease allocator: where a job's tensors come from while it runs in an
// agent. It is the engine's Allocator over a stack of memory resources
// (agent/memory/): leased pages shown in a window of addresses (PagedResource),
// under the job's budget (BudgetAdaptor), asking the spill manager's
// reclaimer before an allocation fails (ReclaimingAdaptor), counted
// (StatisticsAdaptor). No message goes to the coordinator for memory the
// job holds already.
//
// Free space is never stranded in fragments: a request fails only when the
// pages its live tensors touch and the pages the request needs exceed the
// budget (paged_resource.h says why; tensors of whole pages need exactly
// their size, others at most the partly used pages at their ends). A
// lease lost to a coordinator restart is never allocated from again; the
// tensors in it are void (the job running on them must be abandoned).
//
// Before any memory leaves the job (empty_cache, destruction, pages hidden
// to be shown elsewhere) the allocator waits for the device work queued on
// it (engine::fence_device), so no kernel still writes into memory the
// coordinator may already have leased to someone else.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>

#include "agent/engine/allocator.h"
#include "agent/memory/paged_resource.h"
#include "agent/memory/resource_adaptors.h"
#include "lease_client/session.h"

namespace leasehold {

struct LeaseAllocatorOptions {
  // Most bytes this allocator may hold at once (0: as much as the pool gives).
  uint64_t budget_bytes = 0;
  uint64_t small_limit = 1ull << 20;  // allocations up to this are placed from the window's top
  uint64_t lease_bytes = 32ull << 20; // the usual lease (larger when a tensor needs more)
  uint64_t granularity = 512;         // tensor offsets and sizes are multiples of this
  // How long a new lease may wait for the coordinator to find memory.
  std::chrono::milliseconds lease_wait{0};
  // The job's guaranteed share and the growth rules past it
  // (agent/memory/leased_pages.h).
  uint64_t guaranteed_bytes = 0;
  std::optional<std::chrono::milliseconds> guaranteed_wait;
  std::chrono::milliseconds growth_backoff{1000};
  // The fence before memory leaves the job; empty: engine::fence_device on
  // the pool's device. Tests observe it here.
  std::function<void()> fence;

  // The options for a job with this budget: leases of an eighth of it
  // (between 2 and 32 MiB), so a small budget is not asked for in a few
  // big leases the pool may not have room for.
  static LeaseAllocatorOptions for_budget(uint64_t budget);
};

class LeaseAllocator final : public engine::Allocator {
 public:
  // `session` must outlive the allocator and all memory it hands out.
  LeaseAllocator(AgentSession& session, LeaseAllocatorOptions options = {});
  // Fences the device (see above), then releases every lease. Logs, never
  // throws.
  ~LeaseAllocator() override = default;

  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) noexcept override;
  engine::Device device() const override { return paged_.device(); }
  engine::AllocatorStats stats() const override;
  void set_reclaimer(engine::Reclaimer reclaimer) override;
  void set_idle_release(engine::Reclaimer release) override;
  // Hides pages no live tensor touches (after the fence), to be shown under
  // the next tensor, unless a free range already has enough of its pages
  // shown: only as many as the range it will land in lacks, when enough
  // lie outside it (PagedResource::make_room); the leases stay the job's.
  void reuse_idle(size_t bytes) override;
  void* allocate_if_free(size_t bytes) override;
  uint64_t budget() const override { return budget_.budget(); }
  // Gives back what no live tensor uses (after the fence): whole free
  // leases and free lease tails. Throws CudaError when the fence reports a
  // device fault.
  void empty_cache();

 private:
  // The reclaiming adaptor's question: memory held only for speed, else
  // spill, else (once) let growth past the guaranteed share wait.
  bool reclaim(uint64_t bytes, std::string& why_not);
  // This thread's compute stream on the pool's device (nullptr on host);
  // `make`: create it when the thread has none yet (not for frees).
  StreamRef stream(bool make) const;

  PagedResource paged_;
  BudgetAdaptor budget_;
  ReclaimingAdaptor reclaiming_;
  StatisticsAdaptor counted_;
  mutable std::mutex mu_;
  engine::Reclaimer reclaimer_;     // GUARDED_BY(mu_)
  engine::Reclaimer idle_release_;  // GUARDED_BY(mu_)
};

}  // namespace leasehold
