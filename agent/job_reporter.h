// Delivers a job's reports to the coordinator from a thread of its own, so
// the training thread never waits for the coordinator. Progress is
// best-effort (only the latest is kept); epoch reports and final states are
// sent in order and again until the coordinator acknowledges them (it does
// once they are stored), also across a coordinator restart, with a growing
// pause (up to 1 s) between tries. A report the coordinator refuses for good
// (NotOwner, InvalidArgument: not this agent's job or attempt any more) is
// dropped.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "agent/job_channel.h"

namespace leasehold {

class JobReporter {
 public:
  // `jobs` (and its session) must outlive the reporter's thread (see stop()).
  explicit JobReporter(JobChannel& jobs);
  // stop(drain). Never throws.
  ~JobReporter();
  JobReporter(const JobReporter&) = delete;
  JobReporter& operator=(const JobReporter&) = delete;

  // The latest progress of a running job; replaces progress not yet sent.
  void progress(proto::JobUpdateT update);
  // An epoch report, a final state (any state but "running" is final), or
  // a chunk of a program's output. Output waiting to be sent is bounded
  // (kMaxQueuedOutput): past it the oldest chunks not being sent are
  // dropped, and the coordinator notes the gap their offsets leave.
  void reliable(proto::JobUpdateT update);
  static constexpr size_t kMaxQueuedOutput = 2u << 20;
  // Jobs (id, attempt) whose final report is not acknowledged yet.
  std::vector<std::pair<uint64_t, uint32_t>> pending_finals() const;
  // Waits until nothing is pending; false after `timeout`.
  bool flush(std::chrono::milliseconds timeout);
  // Tries for up to `drain` to deliver what is pending (an agent that stops
  // reports its interrupted job), logs what it could not, and ends the
  // thread; later reports are dropped. Idempotent; call it before the
  // session goes away.
  void stop(std::chrono::milliseconds drain);

 private:
  void loop();

  JobChannel& jobs_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<proto::JobUpdateT> reliable_;          // GUARDED_BY(mu_)
  std::map<uint64_t, proto::JobUpdateT> progress_;  // by job id; GUARDED_BY(mu_)
  bool sending_ = false;                            // GUARDED_BY(mu_)
  size_t queued_output_ = 0;                        // log bytes in reliable_; GUARDED_BY(mu_)
  bool stop_ = false;                               // GUARDED_BY(mu_)
  std::chrono::milliseconds backoff_{0};            // GUARDED_BY(mu_)
  std::mutex stop_mu_;                              // serializes stop()
  std::thread thread_;
};

}  // namespace leasehold
