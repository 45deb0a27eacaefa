#include "coordinator/scheduler.h"

namespace leasehold {

JobRecord* FifoPolicy::pick_job(const AgentRecord&, std::span<JobRecord* const> queued) {
  // Every agent maps the same pool, so any queued job suits any agent; the
  // core has already left out jobs whose device does not match the pool.
  return queued.empty() ? nullptr : queued.front();
}

bool FifoPolicy::may_grant(const PendingRequest&, const LeaseTable&) { return true; }

}  // namespace leasehold
