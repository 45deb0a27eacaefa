// The seam for scheduling decisions: which queued job an idle agent starts,
// and whether a lease request that fits may be granted now. The core asks
// the policy and does the bookkeeping; a policy never changes state.
//
// FifoPolicy is the first implementation (the behaviour before policies
// existed): jobs start in queue order on any idle agent, and a lease is
// granted whenever the pool has room for it. The occupancy policy
// (watermarks, budgets, shrinking) will be the second.
#pragma once

#include <span>

#include "coordinator/agent_record.h"
#include "coordinator/job_table.h"
#include "coordinator/lease_table.h"

namespace leasehold {

class SchedulingPolicy {
 public:
  virtual ~SchedulingPolicy() = default;
  // The job `agent` (idle, registered) should start, chosen from `queued`
  // (in queue order, only jobs no agent still runs); nullptr for none.
  virtual JobRecord* pick_job(const AgentRecord& agent, std::span<JobRecord* const> queued) = 0;
  // Whether `request`, which fits the pool now, may be granted now. A
  // request refused here waits (until its deadline) like one that does not fit.
  virtual bool may_grant(const PendingRequest& request, const LeaseTable& leases) = 0;
};

class FifoPolicy final : public SchedulingPolicy {
 public:
  JobRecord* pick_job(const AgentRecord& agent, std::span<JobRecord* const> queued) override;
  bool may_grant(const PendingRequest& request, const LeaseTable& leases) override;
};

}  // namespace leasehold
