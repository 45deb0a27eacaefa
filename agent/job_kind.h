// The kinds of job an agent's worker runs (agent/job_worker.h): an engine job
// (agent/engine_job.h: a model described in the job file, trained by the
// engine inside the agent's leases) and a program job (agent/program_job.h:
// an unmodified program run as the agent's child, its CUDA memory leased by
// its own session through the PyTorch plug-in). The worker takes the
// assignment, reports, stops the job and ends its attempt the same way for
// every kind; a kind runs the job itself, on the worker's thread.
#pragma once

#include <cstdint>
#include <cstdio>
#include <functional>
#include <string>

#include "agent/job_reporter.h"
#include "agent/job_runner.h"
#include "agent/lease_allocator.h"
#include "agent/replica.h"
#include "shared/checkpoint_folder.h"

namespace leasehold {

// One attempt of a job, as the worker hands it to the job's kind: who it is,
// and how the kind talks back. Everything here is the worker's.
struct JobAttempt {
  uint64_t id = 0;
  uint32_t attempt = 0;
  std::string name;
  CheckpointOwner checkpoint_owner;
  std::string job_token;  // AssignJob's, for a program's session
  Replica replica;        // which replica of a data-parallel job it runs
  // True: end the job now (throw JobCancelled). While the coordinator has
  // been silent too long, it first pauses (the self-fence). Cheap.
  std::function<bool()> should_stop;
  // True once the job is being stopped; unlike should_stop, safe to ask
  // from any thread (a wait on another replica asks it).
  std::function<bool()> stopping;
  // Where the worker answers Shrinks and injects test faults: call between
  // steps, with the job's allocator and spill manager (null: none).
  std::function<void(LeaseAllocator*, spill::SpillManager*)> at_step_boundary;
  // True while a Shrink for this job waits for at_step_boundary's answer:
  // memory the job holds for speed alone (a CUDA graph's pool) goes first.
  std::function<bool()> shrink_pending;
  // A "running" update of this attempt (with resumed_from_epoch).
  std::function<proto::JobUpdateT()> update;
  // The attempt resumed after `epoch`: its updates say so from now on.
  std::function<void(int64_t epoch)> resumed;
  // Where the job is now (named when it is interrupted).
  std::function<void(int64_t epoch, int64_t global_step)> position;
  JobReporter* reporter = nullptr;
};

// How a job ended that was not stopped (JobCancelled) and did not throw.
struct JobEnd {
  JobResult result;      // the engine's figures (test accuracy, samples/s, memory)
  int exit_code = -1;    // a program's exit status
  std::string failure;   // non-empty: it failed, for this reason
};

class JobKind {
 public:
  virtual ~JobKind() = default;
  // Runs the job to its end. Throws JobCancelled when should_stop asked it
  // to end; any other exception fails it (the worker tells a lost session
  // or a lost device from the job's own failure).
  virtual JobEnd run(const proto::JobSpec& job, JobAttempt& attempt) = 0;
};

// What the worker and the kinds print for an operator watching the agent.
template <class... Args>
void say(const char* fmt, Args... args) {
  std::printf(fmt, args...);
  std::fflush(stdout);
}

}  // namespace leasehold
