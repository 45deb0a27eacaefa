// The coordinator's jobs: the queue (priority, then submission order), each
// job's state with its history, attempts and results. Pure bookkeeping: the
// core decides the transitions, this keeps them consistent.
//
// Thread safety: none; the coordinator's core owns it.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "schemas/leasehold_generated.h"
#include "shared/interruption.h"
#include "shared/session_token.h"

namespace leasehold {

class AgentProcess;  // coordinator/agent_process.h

using Clock = std::chrono::steady_clock;

// Reasons kept in a job record (its reason, each state change's and each
// attempt's) are cut to this many bytes, and an agent's own words to fewer,
// leaving room for the coordinator's context around them: a page of job
// summaries stays far below the protocol's message size.
inline constexpr size_t kReasonBytes = 1024;
// A job's output kept (a program job's log): the latest this many bytes.
inline constexpr size_t kJobLogBytes = 1 << 20;
// One JobUpdate carries at most this much of it.
inline constexpr size_t kJobLogChunkBytes = 64 << 10;
// One GetJobLog answer carries at most this much of it.
inline constexpr size_t kJobLogReplyBytes = 256 << 10;
inline constexpr size_t kAgentReasonBytes = 512;

enum class JobState { Queued, Running, Succeeded, Failed, Cancelled };
const char* job_state_name(JobState s);
std::optional<JobState> parse_job_state(std::string_view s);
// On the wire (JobInfo.status, StateChange.status); Interrupted and Unset
// are no job's state.
proto::JobStatus job_status(JobState s);
std::optional<JobState> job_state_of(proto::JobStatus s);
inline bool is_terminal(JobState s) { return s != JobState::Queued && s != JobState::Running; }

// One run of a job on an agent.
struct AttemptRecord {
  uint32_t number = 0;  // 1, 2, ...
  std::string agent;
  uint64_t started_ms = 0;
  uint64_t ended_ms = 0;  // 0 while it runs
  std::string outcome;    // see Attempt in schemas/leasehold.fbs
  std::string reason;
  int32_t resumed_from_epoch = 0;
  std::string agent_identity;  // see Attempt in schemas/leasehold.fbs
  std::string cause;           // an interrupted attempt's (interruption_name)
  // A data-parallel job's agents of ranks 1, 2, ... (`agent` runs rank 0).
  std::vector<std::string> replica_agents;
};

struct JobRecord {
  // ---- Stored (coordinator/job_codec.h turns these into a JobInfo) ----
  uint64_t id = 0;
  std::string name;
  int priority = 0;
  std::string device;  // auto, cuda or cpu
  std::shared_ptr<const proto::JobSpecT> spec;
  JobState state = JobState::Queued;
  std::string agent;   // of the latest attempt
  std::string reason;  // why it failed, was cancelled or last requeued
  uint64_t submitted_ms = 0;
  uint64_t finished_ms = 0;  // when it reached its final state
  // Who submitted it (kernel credentials of an ipc:// client); unset when
  // unknown (tcp://, or stored by an earlier version): then only
  // administrators may cancel it.
  std::optional<uint32_t> submitted_uid;
  std::string submitted_by;  // the user's name then
  std::string submit_key;    // SubmitJob.key: its retries find this job
  // A program job (spec->program): the token of its current attempt, which
  // its process presents to register a session of its own (not stored: a
  // coordinator restart voids every session anyway), and what it reported.
  SessionToken program_token;
  int32_t exit_code = -1;
  proto::ProgramMemoryT program_memory;
  // Its output (standard output and error), the latest kJobLogBytes of it:
  // `log_bytes` in all so far, `log` the tail. `attempt_log_bytes`: of the
  // current attempt's output, how much arrived (chunks come with offsets).
  std::string log;
  uint64_t log_bytes = 0;
  uint64_t attempt_log_bytes = 0;
  bool is_program() const { return spec && spec->program; }
  std::vector<proto::StateChangeT> history;
  proto::ProgressT progress;
  std::vector<proto::EpochStatT> epochs;  // in epoch order, one per epoch (the latest kept)
  // Oldest epochs and history entries dropped to stay within the limits
  // (CoreOptions::epochs_kept, history_kept): the totals are these plus the
  // sizes.
  uint32_t epochs_dropped = 0, history_dropped = 0;
  double test_accuracy = 0, samples_per_second = 0;
  bool cancel_requested = false;
  std::string cancelled_by;  // who asked (a user name, "uid N" or "administrator")
  // Interruptions so far by cause (interruption_name): every one, also
  // those whose attempts are no longer kept.
  std::map<std::string, uint32_t> interruptions;
  std::vector<AttemptRecord> attempts;
  uint32_t agent_failures = 0;  // attempts that ended with the agent lost
  int32_t max_attempts = 3;     // requeues allowed after agent losses
  std::string checkpoint;       // the checkpoint file; empty: none
  uint64_t memory_wait_ms = 0;  // queued for its guaranteed share, or lease requests waiting
  uint32_t shrinks = 0;         // Shrinks its agents answered
  uint64_t shrunk_bytes = 0;    // and the bytes they released
  // The latest attempt's start (Unix µs): assigned by the coordinator, and
  // its first training step begun on the agent (0: not yet).
  uint64_t assigned_at_us = 0;
  uint64_t first_step_at_us = 0;

  // ---- Not stored ----
  // Its guaranteed share (memory_min, else memory_budget), set when it is
  // queued or restored.
  uint64_t guaranteed_bytes = 0;
  uint64_t budget_bytes = 0;  // memory_budget on this pool: the most it may hold
  // Queued: why the policy does not start it yet, and since when it waits
  // for memory.
  std::string waiting_for;
  std::optional<Clock::time_point> waiting_since;
  // The conversation with the agent running it:
  bool assign_acked = false;  // the agent's heartbeat showed the assignment
  // A data-parallel job: the same for ranks 1, 2, ... (rank - 1 indexes
  // them), and which of those reported their success (and so stop listing
  // the job while the gang goes on).
  std::vector<bool> replicas_acked, replicas_succeeded;
  // Where its rank 0 serves the replicas' rendezvous (AssignJob.master_port).
  uint16_t master_port = 0;
  bool stop_wanted = false;   // StopJob is due for a reason other than a cancel
  Clock::time_point assign_sent{};
  // When this coordinator assigned the current attempt (unset for one
  // recovered from the store).
  std::optional<Clock::time_point> assigned_steady;
  Clock::time_point stop_sent{};
  // When the coordinator first saw its cancel with an agent on it: the
  // agent has stop_timeout from then to end it.
  std::optional<Clock::time_point> cancel_since;
  // Set for a running job whose agent has not said whether it still runs it
  // (the coordinator restarted, or the agent registered again or fell
  // silent while its process lives on).
  std::optional<Clock::time_point> orphaned_since;
  bool orphan_counts = false;  // if the wait runs out, it counts as a lost agent
  // What it waits after: a restart, a lost session or a silent agent.
  Interruption orphan_kind = Interruption::CoordinatorRestart;
  // The silent agent's process (null: not followed).
  std::shared_ptr<AgentProcess> orphan_process;
  // Why the coordinator dropped its agent, when the agent's own report of
  // the interruption cannot know it (it did not answer a Shrink).
  std::string orphan_cause;
  // Under MPS: its GPU context was lost in a fault that took several jobs
  // down at once, so it may have caused it. It runs alone on the GPU until
  // it reports an epoch or has run for fault_probation (probation_since:
  // its first step of that run), so a fault then is surely its own.
  bool fault_suspect = false;
  std::optional<Clock::time_point> probation_since;

  AttemptRecord* current_attempt() { return attempts.empty() ? nullptr : &attempts.back(); }
  // Its submitter as Peer::identity() names them: "uid N", or "key NAME".
  std::string submitter() const {
    return submitted_uid ? "uid " + std::to_string(*submitted_uid) : submitted_by;
  }
  uint32_t attempt_number() const { return attempts.empty() ? 0 : attempts.back().number; }
  // Data-parallel replicas it runs as (JobSpec.replicas; 1: a plain job).
  int replicas() const { return spec && spec->replicas > 1 ? spec->replicas : 1; }
  // The rank the latest attempt runs on agent `name` (0: `agent`), or -1.
  int rank_on(const std::string& name) const;
  // The agents of the latest attempt, by rank.
  std::vector<std::string> gang() const;
  // The latest epoch whose checkpoint was written; 0 when none.
  int32_t last_checkpoint_epoch() const;
};

// The jobs, with the indexes that keep submission and scheduling O(log n)
// in the number of jobs: the queue in start order, the running jobs, and
// each submitter's queued count. Every state change goes through
// set_state(), which keeps them.
class JobTable {
 public:
  // A queued job's place: higher priority first, then submission order.
  struct QueueKey {
    int32_t priority;
    uint64_t id;
    bool operator<(const QueueKey& o) const {
      return priority != o.priority ? priority > o.priority : id < o.id;
    }
  };
  // The waiting_for of a queued job that is not first in line.
  static constexpr const char* kBehind = "queued behind earlier jobs";

  // Adds a queued job of `submitted_uid`/`submitted_by` under the next id
  // and returns it.
  JobRecord& add(std::shared_ptr<const proto::JobSpecT> spec, uint64_t now_ms,
                 std::optional<uint32_t> submitted_uid = std::nullopt,
                 std::string submitted_by = "");
  // Puts back a job read from the store (the next id stays above it).
  void restore(JobRecord job);
  JobRecord* find(uint64_t id);
  const JobRecord* find(uint64_t id) const;
  void erase(uint64_t id);
  // Queued jobs in the order they should start.
  const std::set<QueueKey>& queue() const { return queue_; }
  // Running jobs, by id.
  const std::set<uint64_t>& running() const { return running_; }
  // Queued jobs of `submitter` (JobRecord::submitter()).
  uint32_t queued_by(const std::string& submitter) const;
  // Jobs in `state`.
  size_t count(JobState state) const { return by_state_[static_cast<size_t>(state)]; }
  // Moves `job` to `state` and records it in the history (with `reason`,
  // which becomes the job's reason unless it starts running).
  void set_state(JobRecord& job, JobState state, uint64_t now_ms, const std::string& reason = "");
  // History entries kept per job (the oldest go first).
  void set_history_kept(size_t n) { history_kept_ = n; }
  const std::map<uint64_t, JobRecord>& all() const { return jobs_; }
  std::map<uint64_t, JobRecord>& all() { return jobs_; }
  uint64_t next_id() const { return next_id_; }
  // Never lowers it: ids are not reused.
  void raise_next_id(uint64_t id) { next_id_ = std::max(next_id_, id); }

 private:
  void index(const JobRecord& job);
  void unindex(const JobRecord& job);

  std::map<uint64_t, JobRecord> jobs_;
  std::set<QueueKey> queue_;
  std::set<uint64_t> running_;
  std::map<std::string, uint32_t> queued_by_;
  std::array<size_t, 5> by_state_{};  // by JobState
  uint64_t next_id_ = 1;
  size_t history_kept_ = SIZE_MAX;
};

}  // namespace leasehold
