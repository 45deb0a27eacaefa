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
// Thread safety: the session's heartbeat thread calls the handlers; run()
// is called from one thread; session_changed() from the session listener.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "agent/job_reporter.h"
#include "agent/session.h"

namespace leasehold {

class JobWorker {
 public:
  // Installs the session's job handlers. The session must outlive the
  // worker, and the worker must outlive the session's heartbeat thread
  // (hold it in a shared_ptr captured by the session listener).
  explicit JobWorker(AgentSession& session);
  // Runs assigned jobs until `stop` is set (a running job is interrupted
  // and reported so).
  void run(const std::atomic<bool>& stop);
  // Call from the session listener: a lost session (`why` non-empty) voids
  // the leases, so the running job is stopped; a new session (empty) is
  // announced with a heartbeat.
  void session_changed(const std::string& why);
  // After run() returned and before the session is destroyed: delivers the
  // last reports (for up to `drain`) and stops reporting.
  void finish(std::chrono::milliseconds drain) { reporter_.stop(drain); }

 private:
  using Key = std::pair<uint64_t, uint32_t>;  // job id, attempt
  struct Assigned {
    Key key;
    std::vector<uint8_t> spec;
  };
  enum class StopCause { None, Cancel, SessionLost, AgentStopping };

  void on_assign(uint64_t id, uint32_t attempt, std::vector<uint8_t> spec);
  void on_stop(uint64_t id, uint32_t attempt);
  std::vector<proto::AgentJobT> job_states();
  void run_one(const Assigned& job, const std::atomic<bool>& stop);
  // Remembers a finished job so late pushes for it are ignored.
  void remember(const Key& key);  // REQUIRES: mu_ held
  bool known(const Key& key) const;  // REQUIRES: mu_ held
  proto::JobUpdateT final_update(const Key& key, const std::string& state,
                                 const std::string& reason) const;

  AgentSession& session_;
  JobReporter reporter_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Assigned> queue_;     // GUARDED_BY(mu_)
  std::optional<Key> current_;     // GUARDED_BY(mu_)
  StopCause stop_cause_ = StopCause::None;  // GUARDED_BY(mu_)
  std::string session_loss_;       // why the session was lost; GUARDED_BY(mu_)
  std::deque<Key> finished_;       // the latest finished jobs; GUARDED_BY(mu_)
  int32_t resumed_from_epoch_ = 0;  // of the current job; GUARDED_BY(mu_)
  std::atomic<bool> stop_requested_{false};  // the running job should stop
  std::atomic<int64_t> epoch_{0}, global_step_{0};  // of the current job
};

}  // namespace leasehold
