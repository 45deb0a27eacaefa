// The occupancy policy: more jobs than the pool holds at once, on one GPU,
// without out-of-memory failures. FlashNeuron's occupancy queries
// (device_occupancy, device_occupancy_future) turned into AntMan-style
// guaranteed and opportunistic shares. The rules, their rationale and the
// defaults' trade-offs are in coordinator/occupancy.md; in short:
//
// - A running job is guaranteed its memory_min (else its memory_budget) and
//   may lease more, up to its budget, while occupancy_future stays at or
//   below the low watermark; growth it cannot do without (nothing left to
//   spill) up to the high watermark, asking others' growth back beyond it.
// - A lease within a guaranteed share (or of an agent without a job) is
//   granted when it fits and occupancy stays at or below the high
//   watermark; above it (or when the free memory is in pieces too small
//   for it) it waits while someone holds memory past their guaranteed
//   share, and the policy asks those agents to shrink (lowest priority
//   first, then the most over their share), never below it.
// - A queued job starts when its guaranteed share fits: free memory (not
//   reserved for running jobs) plus what jobs of its priority or lower hold
//   past their shares, plus idle shared cache regions (evicted for it). Jobs
//   start in queue order (priority, then submission): a large job is never
//   starved by small ones behind it.
// - A shared cache region is placed like speculative growth: only while
//   occupancy_future stays at or below the low watermark.
#pragma once

#include "coordinator/scheduler.h"

namespace leasehold {

struct OccupancyOptions {
  double low_watermark = 0.80;
  double high_watermark = 0.95;
};

class OccupancyPolicy final : public SchedulingPolicy {
 public:
  // Throws std::invalid_argument unless 0 < low <= high <= 1.
  explicit OccupancyPolicy(OccupancyOptions options);
  const char* name() const override { return "occupancy"; }
  double low_watermark() const override { return opt_.low_watermark; }
  double high_watermark() const override { return opt_.high_watermark; }
  Pick pick_job(const AgentRecord& agent, std::span<JobRecord* const> queued,
                const PoolView& pool) override;
  bool may_grant(const PendingRequest& request, const PoolView& pool) override;
  std::vector<ShrinkOrder> shrinks(const PoolView& pool) override;
  bool may_cache(uint64_t bytes, const PoolView& pool) override;

 private:
  uint64_t low_bytes(const PoolView& pool) const;
  uint64_t high_bytes(const PoolView& pool) const;
  // Used and reserved bytes if the growth `request` were granted (its own
  // reservation not counted twice).
  static uint64_t growth_future(const PendingRequest& request, const PoolView& pool);
  // Shrinks asking agents over their share for `need` bytes (less what is
  // being released already), lowest priority first; for a `needy` request,
  // only from other jobs of its priority or lower.
  static std::vector<ShrinkOrder> orders(const PoolView& pool, uint64_t need,
                                         const PendingRequest* needy, const std::string& why);

  OccupancyOptions opt_;
};

}  // namespace leasehold
