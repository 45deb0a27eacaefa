// The standby agent's job loop: takes jobs the coordinator assigns, runs each
// inside its own lease allocator (the job's memory budget), reports progress
// about once a second, each epoch's test accuracy and the outcome, releases
// its leases, and goes back to standby, also after a failing job.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <vector>

#include "agent/session.h"

namespace leasehold {

class JobWorker {
 public:
  // Installs the session's job handlers. The session must outlive the
  // worker's use by those handlers (they run on its heartbeat thread).
  explicit JobWorker(AgentSession& session);
  // Runs assigned jobs until `stop` is set (a running job is cancelled).
  void run(const std::atomic<bool>& stop);
  // Call from the session listener: a lost session voids the leases, so a
  // running job is stopped; a new session resets the duplicate filter.
  void session_changed(const std::string& why);

 private:
  void run_one(uint64_t id, const std::vector<uint8_t>& spec, const std::atomic<bool>& stop);
  void report(const proto::JobUpdateT& update);

  AgentSession& session_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<uint64_t, std::vector<uint8_t>>> queue_;  // GUARDED_BY(mu_)
  std::atomic<uint64_t> current_{0};
  std::atomic<bool> cancel_{false};
  // GUARDED_BY(mu_). A push can arrive on two sockets; ids grow within one
  // coordinator session, and this is reset when the agent registers again.
  uint64_t last_assigned_ = 0;
};

}  // namespace leasehold
