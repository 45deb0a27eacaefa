// The lease-local caching allocator: tensors of a job are carved out of the
// agent's leases without any message to the coordinator. Like PyTorch's CUDA
// caching allocator it keeps two pools (small allocations ≤ 1 MiB in small
// segments, larger ones in large segments) so small tensors do not fragment
// the space big ones need; inside each segment (one lease) blocks are placed
// best fit, split, and merged with free neighbours on release. Freed blocks
// stay cached for reuse; a new lease is requested only when no segment has
// room, and fully free segments are handed back by empty_cache() or when a
// request would otherwise fail.
//
// A lease lost to a coordinator restart is never allocated from again; the
// tensors in it are void (the job running on them must be abandoned).
//
// Before any lease goes back to the coordinator (empty_cache, a retry after
// a refusal, destruction) the allocator waits for the device work queued on
// its memory (engine::fence_device), so no kernel still writes into memory
// the coordinator may already have leased to someone else.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include "agent/engine/allocator.h"
#include "lease_client/session.h"
#include "shared/error.h"
#include "shared/pool_allocator.h"

namespace leasehold {

// The engine device a pool's memory is on: cuda:N, or the CPU for a host pool.
inline engine::Device pool_device(const PoolDescriptor& pool) {
  return pool.backend == Backend::Cuda ? engine::Device::cuda(pool.device) : engine::Device::cpu();
}

struct LeaseAllocatorOptions {
  // Most bytes this allocator may lease at once (0: as much as the pool gives).
  uint64_t budget_bytes = 0;
  uint64_t small_limit = 1ull << 20;      // allocations up to this go to the small pool
  uint64_t small_segment = 2ull << 20;    // lease size of a small segment
  uint64_t large_segment = 32ull << 20;   // minimum lease size of a large segment
  uint64_t granularity = 512;             // tensor offsets and sizes are multiples of this
  // How long a new lease may wait for the coordinator to find memory.
  std::chrono::milliseconds lease_wait{0};
  // The job's guaranteed share (0: none; every lease waits `lease_wait`).
  // A lease that keeps the allocator within it waits up to `guaranteed_wait`
  // (nullopt: the coordinator's default): the occupancy policy makes room
  // for it. One past it (opportunistic growth) waits `lease_wait`: refused
  // at once, the job spills instead, and does not ask to grow again for
  // `growth_backoff`. Only when nothing is left to spill does growth wait
  // `guaranteed_wait` before the allocation fails; that request says it is
  // needed (LeaseRequest.needed), which the policy grants up to its high
  // watermark.
  uint64_t guaranteed_bytes = 0;
  std::optional<std::chrono::milliseconds> guaranteed_wait;
  std::chrono::milliseconds growth_backoff{1000};
  // The fence before leases are released; empty: engine::fence_device on
  // the pool's device. Tests observe it here.
  std::function<void()> fence;

  // The options for a job with this budget: large segments of an eighth of
  // it (between 2 and 32 MiB), so a small budget is not locked up in a few
  // big, partly used segments.
  static LeaseAllocatorOptions for_budget(uint64_t budget);
};

class LeaseAllocator final : public engine::Allocator {
 public:
  // `session` must outlive the allocator and all memory it hands out.
  LeaseAllocator(AgentSession& session, LeaseAllocatorOptions options = {});
  // Fences the device (see above), then releases every lease. Logs, never
  // throws.
  ~LeaseAllocator() override;

  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) noexcept override;
  engine::Device device() const override { return device_; }
  engine::AllocatorStats stats() const override;
  void set_reclaimer(engine::Reclaimer reclaimer) override;
  void* allocate_if_free(size_t bytes) override;
  uint64_t budget() const override { return opt_.budget_bytes; }
  // Returns the leases of segments with nothing allocated in them (after the
  // fence). Throws CudaError when the fence reports a device fault.
  void empty_cache();

 private:
  struct Segment {
    Lease lease;
    PoolAllocator blocks;
    bool small;
    Segment(Lease l, uint64_t granularity, bool is_small)
        : lease(std::move(l)), blocks(lease.size(), granularity), small(is_small) {}
  };
  struct Placement {
    Segment* segment;
    uint64_t offset;
    uint64_t size;
  };

  // Places `need` bytes in `seg` and records it; nullptr when it has no room.
  void* place(Segment& seg, uint64_t need);  // REQUIRES: mu_ held
  void* try_segments(uint64_t need, bool small);  // REQUIRES: mu_ held
  // Places `need` bytes, leasing more within the budget; nullptr under
  // budget pressure, with the reason in `why`. `patient`: growth past the
  // guaranteed share may wait (the last resort). REQUIRES: mu_ held.
  void* try_allocate(uint64_t need, bool small, std::string& why, bool patient = false);
  // A new segment of `size` bytes; nullptr when the coordinator refused it
  // (reason in `why`). REQUIRES: mu_ held.
  Segment* lease_segment(uint64_t size, bool small, std::string& why, bool patient);
  // Whether growth past the guaranteed share was refused recently.
  bool growth_held() const;  // REQUIRES: mu_ held
  size_t release_free_segments();  // REQUIRES: mu_ held
  void fence();
  [[noreturn]] void out_of_memory(uint64_t bytes, const std::string& why);

  AgentSession& session_;
  LeaseAllocatorOptions opt_;
  engine::Device device_;
  mutable std::mutex mu_;
  engine::Reclaimer reclaimer_;                          // GUARDED_BY(mu_)
  std::list<Segment> segments_;                          // GUARDED_BY(mu_)
  std::unordered_map<void*, Placement> placements_;      // GUARDED_BY(mu_)
  uint64_t leased_ = 0, in_use_ = 0, peak_ = 0, allocations_ = 0;  // GUARDED_BY(mu_)
  uint64_t peak_leased_ = 0;                                       // GUARDED_BY(mu_)
  std::chrono::steady_clock::time_point no_growth_until_{};        // GUARDED_BY(mu_)
  // Why the coordinator last refused a lease (for the out-of-memory advice).
  std::optional<ErrorCode> last_refusal_;                          // GUARDED_BY(mu_)
};

}  // namespace leasehold
