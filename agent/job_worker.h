// The standby agent's job loop: takes jobs the coordinator assigns, runs each
// inside its own lease allocator (the job's memory budget), reports progress
// about once a second, each epoch and the outcome (through a JobReporter, so
// training never waits for the coordinator), releases its leases, and goes
// back to standby, also after a failing job.
//
// Every job is known by (id, attempt); duplicates of a push are ignored. A
// stop for a job that has not started yet, or is not known at all (its
// assignment was lost), is answered with a "cancelled" report, so a cancel
// racing an assignment is never lost. When the coordinator session is lost
// the running job stops at the next step, its memory is fenced and released,
// and it is reported "interrupted" (the coordinator requeues it to resume
// from its checkpoint), never as a misleading failure.
//
// A device fault (a kernel's, or under MPS any client's) ends the process's
// CUDA context for good: the running job is reported "interrupted" with
// device_fault (the coordinator requeues it; it resumes from its checkpoint)
// and run() returns; the agent then starts itself again. An idle worker
// checks its context about once a second, so a fault beside it is noticed
// too.
//
// A Shrink from the coordinator is acted on at the running job's next step
// boundary: the lease allocator's cached blocks go back first, then cold
// saved tensors move to the spill store, then whole free leases are
// released; ShrinkDone says how much was released. A Shrink for a job that
// is not running here is answered with nothing released.
//
// Thread safety: the session's heartbeat thread calls the handlers and the
// session listener; run() is called from one thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent/job_channel.h"
#include "agent/job_kind.h"
#include "agent/program_job.h"
#include "agent/job_reporter.h"
#include "agent/lease_allocator.h"
#include "agent/spill/agent_spill.h"
#include "lease_client/session.h"

namespace leasehold {

struct JobWorkerOptions {
  // Jobs keep their datasets in shared cache regions (false: each job
  // decodes its own into host memory and copies every batch over).
  bool dataset_regions = true;
  // How program jobs are run (agent/program_job.h).
  ProgramJobOptions programs;
  // A fault switch for tests: an agent that never answers Shrink.
  bool ignore_shrinks = false;
  // A fault switch for tests: jobs named this make the GPU fault at their
  // test_fault_step-th step (kernels/fault.h).
  std::string test_fault_job;
  int64_t test_fault_step = 100;
};

class JobWorker {
 public:
  // Installs the session's job handlers and its listener, which also calls
  // `announce` (with the listener's argument). Jobs spill through `spill`
  // (null: they do not spill). The session and `spill` must outlive the
  // worker.
  explicit JobWorker(AgentSession& session,
                     std::function<void(const std::string&)> announce = {},
                     spill::AgentSpill* spill = nullptr, JobWorkerOptions options = {});
  // Removes the handlers and the listener (waiting for a call in progress),
  // then delivers the last reports for up to 3 s (see finish()).
  ~JobWorker();
  JobWorker(const JobWorker&) = delete;
  JobWorker& operator=(const JobWorker&) = delete;
  // Runs assigned jobs until `stop` is set (a running job is interrupted
  // and reported so) or the GPU context is lost (see device_lost()).
  void run(const std::atomic<bool>& stop);
  // Why run() returned early: the GPU context was lost (the CUDA error).
  std::optional<std::string> device_lost() const;
  // After run() returned: delivers the last reports (for up to `drain`) and
  // stops reporting.
  void finish(std::chrono::milliseconds drain) { reporter_.stop(drain); }

 private:
  using Key = std::pair<uint64_t, uint32_t>;  // job id, attempt
  struct Assigned {
    Key key;
    std::vector<uint8_t> spec;
    CheckpointOwner checkpoint_owner;
    std::string job_token;
    Replica replica;
    std::chrono::steady_clock::time_point received;  // when the push arrived
  };
  // Why the running job is stopping: a user's cancel, the coordinator
  // wanting it elsewhere, a lost session, the agent stopping.
  enum class StopCause { None, Cancel, Coordinator, SessionLost, AgentStopping };

  void on_assign(JobAssignment job);
  void on_stop(uint64_t id, uint32_t attempt, bool cancel, const std::string& reason);
  void on_shrink(const proto::ShrinkT& shrink);
  // Acts on a pending Shrink: for the running job (`leases`, `spill` its
  // memory), or answered with nothing released when it is not for it.
  void answer_shrink(LeaseAllocator* leases, spill::SpillManager* spill);
  // A lost session (`why` non-empty) voids the leases, so the running job
  // is stopped; a new session (empty) is announced with a heartbeat.
  void session_changed(const std::string& why);
  std::vector<proto::AgentJobT> job_states();
  void run_one(const Assigned& job, const std::atomic<bool>& stop);
  // The self-fence (lease_client/session.h): waits, touching no leased memory,
  // until the coordinator answers again, the session is lost, or the job
  // or agent is asked to stop.
  void pause_while_silent(uint64_t id, const std::atomic<bool>& stop);
  // Remembers a finished job so late pushes for it are ignored.
  void remember(const Key& key);  // REQUIRES: mu_ held
  bool known(const Key& key) const;  // REQUIRES: mu_ held
  std::string session_lost_reason() const;  // REQUIRES: mu_ held
  proto::JobUpdateT final_update(const Key& key, const std::string& state,
                                 const std::string& reason) const;

  AgentSession& session_;
  spill::AgentSpill* spill_;
  // The kinds of job it runs (agent/job_kind.h).
  std::unique_ptr<JobKind> engine_;
  std::unique_ptr<ProgramJob> program_;
  JobChannel jobs_;  // before reporter_, which uses it
  JobReporter reporter_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Assigned> queue_;     // GUARDED_BY(mu_)
  std::optional<Key> current_;     // GUARDED_BY(mu_)
  StopCause stop_cause_ = StopCause::None;  // GUARDED_BY(mu_)
  std::string session_loss_;       // why the session was lost; GUARDED_BY(mu_)
  std::string stop_reason_;        // the coordinator's, for StopCause::Coordinator; GUARDED_BY(mu_)
  std::deque<Key> finished_;       // the latest finished jobs; GUARDED_BY(mu_)
  int32_t resumed_from_epoch_ = 0;  // of the current job; GUARDED_BY(mu_)
  std::optional<proto::ShrinkT> shrink_;  // the latest Shrink not answered; GUARDED_BY(mu_)
  const JobWorkerOptions options_;
  std::optional<std::string> device_lost_;  // GUARDED_BY(mu_)
  std::atomic<bool> stop_requested_{false};  // the running job should stop
  std::atomic<int64_t> epoch_{0}, global_step_{0};  // of the current job
};

}  // namespace leasehold
