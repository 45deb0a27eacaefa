// The coordinator's jobs: the queue (priority, then submission order), the
// state of each job with its history, the latest progress and per-epoch
// results reported by the agent running it. Pure bookkeeping; the
// coordinator loop sends the messages.
//
// Thread safety: none; the coordinator's loop owns it.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "schemas/leasehold_generated.h"

namespace leasehold {

enum class JobState { Queued, Running, Succeeded, Failed, Cancelled };
const char* job_state_name(JobState s);
std::optional<JobState> parse_job_state(std::string_view s);
inline bool is_terminal(JobState s) { return s != JobState::Queued && s != JobState::Running; }

struct JobRecord {
  uint64_t id = 0;
  std::string name;
  int priority = 0;
  std::string device;  // auto, cuda or cpu
  std::shared_ptr<proto::JobSpecT> spec;
  JobState state = JobState::Queued;
  std::string agent;   // while running and after
  std::string reason;  // why it failed or was cancelled
  uint64_t submitted_ms = 0;
  std::vector<proto::StateChangeT> history;
  proto::ProgressT progress;
  std::vector<proto::EpochStatT> epochs;
  double test_accuracy = 0, samples_per_second = 0;
  bool stop_requested = false;
};

class JobTable {
 public:
  uint64_t submit(std::shared_ptr<proto::JobSpecT> spec);
  JobRecord* find(uint64_t id);
  // Queued jobs in the order they should start.
  std::vector<JobRecord*> queued();
  void set_state(JobRecord& job, JobState state, const std::string& reason = "");
  // Applies an agent's report. Returns false (and changes nothing) when it
  // names a state the job cannot move to.
  bool apply(JobRecord& job, const proto::JobUpdate& update);
  std::vector<JobRecord*> running_on(const std::string& agent);
  const std::map<uint64_t, JobRecord>& all() const { return jobs_; }

 private:
  std::map<uint64_t, JobRecord> jobs_;
  uint64_t next_id_ = 1;
};

uint64_t unix_ms();

}  // namespace leasehold
