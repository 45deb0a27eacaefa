// The seam for scheduling decisions: which queued job an idle agent starts,
// whether a lease request that fits may be granted now, and which agents
// should give memory back. The core builds a PoolView (what the policy may
// know), asks, and does the bookkeeping; a policy never changes state.
//
// Two implementations:
// - FifoPolicy (the behaviour before policies existed): jobs start in queue
//   order on any idle agent, a lease is granted whenever the pool has room,
//   nobody is asked to shrink. Jobs whose budgets add up to more than the
//   pool then fail with out-of-memory at random.
// - OccupancyPolicy (coordinator/occupancy_policy.h): guaranteed shares,
//   watermarks, admission and shrinking; see coordinator/occupancy.md.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "coordinator/agent_record.h"
#include "coordinator/job_table.h"
#include "coordinator/lease_table.h"

namespace leasehold {

// One agent as the policy sees it.
struct AgentShare {
  std::string name;
  uint64_t job_id = 0;          // the job it runs; 0: none (its leases are unmanaged)
  int priority = 0;             // its job's
  uint64_t guaranteed = 0;      // its job's guaranteed share (memory_min, else the budget)
  uint64_t leased = 0;          // what it holds now
  uint64_t shrink_pending = 0;  // asked in a Shrink not answered yet
  bool shrinkable = false;      // runs a job and may be asked now (none pending, not skipped)

  bool managed() const { return job_id != 0; }
  // Bytes held above the guaranteed share.
  uint64_t over() const { return managed() && leased > guaranteed ? leased - guaranteed : 0; }
  // Guaranteed bytes not leased yet.
  uint64_t reserved() const { return managed() && guaranteed > leased ? guaranteed - leased : 0; }
};

// The pool as the policy sees it at one moment.
struct PoolView {
  uint64_t pool_size = 0;
  uint64_t used = 0;          // leased bytes, fenced ones included
  uint64_t largest_free = 0;  // the largest free block
  // Bytes of shared cache regions nobody is attached to: evicted (least
  // recently used first) when a waiting request or an admission needs them.
  uint64_t evictable = 0;
  std::vector<AgentShare> agents;       // registered agents, by name
  std::vector<PendingRequest> waiting;  // lease requests waiting, in queue order

  const AgentShare* find(const std::string& name) const;
  // The agent holding `owner`'s leases; null for a region or a fence.
  const AgentShare* find(const LeaseOwner& owner) const {
    return owner.is_agent() ? find(owner.name) : nullptr;
  }
  // Guaranteed bytes of running jobs not leased yet, plus what agents
  // without a job wait for.
  uint64_t reserved() const;
  // Bytes held above guaranteed shares, by agents that may be asked now,
  // of jobs with priority <= `priority` (all of them by default).
  uint64_t reclaimable(int priority = INT32_MAX) const;
  uint64_t shrink_pending() const;
  // Whether `request` would take its agent above its guaranteed share.
  bool opportunistic(const PendingRequest& request) const;
  double occupancy() const;
  // The occupancy if `bytes` more were leased, reservations included.
  double occupancy_future(uint64_t bytes = 0) const;
};

// A Shrink to send: `agent` should give back `bytes`.
struct ShrinkOrder {
  std::string agent;
  uint64_t bytes = 0;
  std::string reason;
};

// What pick_job decided: the job to start, or why the first one waits.
struct Pick {
  JobRecord* job = nullptr;
  std::string waiting_for;  // "waiting for 512 MiB; 3.10 GiB free, ..." when job is null
};

class SchedulingPolicy {
 public:
  virtual ~SchedulingPolicy() = default;
  virtual const char* name() const = 0;
  // Occupancy below `low` lets jobs grow past their guaranteed share; above
  // `high` the policy asks agents to shrink (1, 1 for a policy without them).
  virtual double low_watermark() const { return 1.0; }
  virtual double high_watermark() const { return 1.0; }
  // The job `agent` (idle, registered) should start, chosen from `queued`
  // (in queue order, only jobs no agent still runs, never empty), and
  // `guaranteed(job)` its guaranteed share.
  virtual Pick pick_job(const AgentRecord& agent, std::span<JobRecord* const> queued,
                        const PoolView& pool) = 0;
  // Whether `request`, which fits the pool now, may be granted now. A
  // request refused here waits (until its deadline) like one that does not
  // fit. `pool.waiting` does not hold `request` when it is a new one.
  virtual bool may_grant(const PendingRequest& request, const PoolView& pool) = 0;
  // Agents to ask for memory now (none of them with a Shrink pending).
  virtual std::vector<ShrinkOrder> shrinks(const PoolView&) { return {}; }
  // Whether a new shared cache region of `bytes` may be placed now (it must
  // also fit). A cache never makes anyone shrink.
  virtual bool may_cache(uint64_t /*bytes*/, const PoolView&) { return true; }
};

class FifoPolicy final : public SchedulingPolicy {
 public:
  const char* name() const override { return "fifo"; }
  Pick pick_job(const AgentRecord& agent, std::span<JobRecord* const> queued,
                const PoolView& pool) override;
  bool may_grant(const PendingRequest& request, const PoolView& pool) override;
};

}  // namespace leasehold
