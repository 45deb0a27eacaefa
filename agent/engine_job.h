// An engine job: the model, dataset and optimizer its job file describes,
// trained by the agent's engine (agent/job_runner.h) inside a lease
// allocator that holds the job to its memory budget, spilling cold tensors
// when the budget is short (agent/spill/).
#pragma once

#include "agent/job_kind.h"
#include "agent/spill/agent_spill.h"
#include "lease_client/session.h"

namespace leasehold {

struct EngineJobOptions {
  // Jobs keep their datasets in shared cache regions (false: each decodes
  // its own into host memory).
  bool dataset_regions = true;
};

class EngineJob final : public JobKind {
 public:
  // `spill` may be null (jobs do not spill); both outlive the object.
  EngineJob(AgentSession& session, spill::AgentSpill* spill, EngineJobOptions options)
      : session_(session), spill_(spill), options_(options) {}
  JobEnd run(const proto::JobSpec& job, JobAttempt& attempt) override;

 private:
  AgentSession& session_;
  spill::AgentSpill* spill_;
  const EngineJobOptions options_;
};

// A JobUpdate's Progress from the runner's.
proto::ProgressT to_progress(const JobProgress& p);

}  // namespace leasehold
