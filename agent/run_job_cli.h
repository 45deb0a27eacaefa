// `leasehold-agent --run-job FILE`: runs one job inside this agent's leases
// and prints progress, per-epoch test accuracy and the result.
#pragma once

#include <atomic>
#include <string>

#include "agent/spill/agent_spill.h"
#include "lease_client/session.h"

namespace leasehold {

struct RunJobOverrides {
  int64_t epochs = 0;       // > 0: replaces the job's epochs
  int64_t train_limit = -1; // >= 0: replaces dataset.train_limit
  int64_t test_limit = -1;
  bool cuda_graphs = true;  // false: every step op by op (JobRunOptions::cuda_graphs)
};

// Exit status: 0 on success, 1 when the job failed (reason printed), 2 for an
// invalid job file, 130 when stopped. The job spills through `spill` (null:
// it does not spill).
int run_job_file(AgentSession& session, const std::string& path, const RunJobOverrides& overrides,
                 const std::atomic<bool>& stop, spill::AgentSpill* spill = nullptr);

}  // namespace leasehold
