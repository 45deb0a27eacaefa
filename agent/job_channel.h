// The agent's job traffic with the coordinator, over its lease-client
// session (lease_client/session.h), which knows nothing of jobs: the jobs
// the coordinator pushes (AssignJob, StopJob) reach the handlers installed
// here, the agent's jobs go out with every Register and Heartbeat, and its
// reports (JobUpdate) go as control requests.
//
// Thread safety: the handlers are called from the session's heartbeat
// thread; the other methods may be called from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "agent/replica.h"
#include "lease_client/session.h"
#include "shared/checkpoint_folder.h"

namespace leasehold {

// A job the coordinator assigned (AssignJob).
struct JobAssignment {
  uint64_t job_id = 0;
  uint32_t attempt = 0;
  std::vector<uint8_t> spec;  // a standalone JobSpec buffer
  // Where its checkpoints may be written and read.
  CheckpointOwner checkpoint_owner;
  // A program job's token for this attempt (AssignJob.job_token_hi/lo):
  // 32 lowercase hex digits, the high 64 bits first; empty when both are 0.
  // Secret: its process presents it when it registers a session of its own
  // (LEASEHOLD_JOB_TOKEN, lease_client/leasehold.h).
  std::string job_token;
  // Its replica, for a data-parallel job.
  Replica replica;
};

class JobChannel {
 public:
  // `on_assign(assignment)`; `on_stop(job_id, attempt, cancel, reason)`
  // (cancel: the user's cancel; else the coordinator wants it stopped).
  using AssignHandler = std::function<void(JobAssignment)>;
  using StopHandler = std::function<void(uint64_t, uint32_t, bool, const std::string&)>;
  // This agent's jobs, for every Register and Heartbeat (how the coordinator
  // learns that a push was acted on, and what an agent still runs after a
  // restart).
  using JobStates = std::function<std::vector<proto::AgentJobT>()>;

  // Installs nothing yet. `session` must outlive the channel.
  explicit JobChannel(AgentSession& session) : session_(session) {}
  // Removes the handlers from the session (waiting for a call in progress).
  ~JobChannel();
  JobChannel(const JobChannel&) = delete;
  JobChannel& operator=(const JobChannel&) = delete;

  // Installs the handlers in the session (empty ones: none). They are
  // called from the heartbeat thread and must return quickly (queue the
  // work); after a push acted on, a heartbeat follows at once. Set before
  // the coordinator may push (right after the session is made). Replacing
  // them waits for calls in progress.
  void set_handlers(AssignHandler on_assign, StopHandler on_stop, JobStates job_states);
  // Reports a job's progress or end to the coordinator. Throws Error (the
  // coordinator's refusal, or Timeout/UnknownSender when it is unreachable).
  void send_update(const proto::JobUpdateT& update);
  // The agent's jobs changed (a phase, a final report delivered): the next
  // heartbeat goes now rather than at the interval.
  void jobs_changed() { session_.heartbeat_soon(); }
  AgentSession& session() const { return session_; }

  // An AssignJob as the worker takes it; nullopt without a spec.
  static std::optional<JobAssignment> parse_assignment(const proto::AssignJob& assign);
  // A program job's token as text (see JobAssignment::job_token).
  static std::string token_text(uint64_t lo, uint64_t hi);

 private:
  AgentSession& session_;
};

}  // namespace leasehold
