#include "coordinator/job_table.h"

#include <algorithm>
#include <chrono>

namespace leasehold {

const char* job_state_name(JobState s) {
  switch (s) {
    case JobState::Queued: return "queued";
    case JobState::Running: return "running";
    case JobState::Succeeded: return "succeeded";
    case JobState::Failed: return "failed";
    case JobState::Cancelled: return "cancelled";
  }
  return "?";
}

std::optional<JobState> parse_job_state(std::string_view s) {
  for (JobState st : {JobState::Queued, JobState::Running, JobState::Succeeded, JobState::Failed,
                      JobState::Cancelled}) {
    if (s == job_state_name(st)) return st;
  }
  return std::nullopt;
}

uint64_t unix_ms() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

uint64_t JobTable::submit(std::shared_ptr<proto::JobSpecT> spec) {
  JobRecord rec;
  rec.id = next_id_++;
  rec.name = spec->name;
  rec.priority = spec->priority;
  rec.device = spec->device.empty() ? "auto" : spec->device;
  rec.spec = std::move(spec);
  rec.submitted_ms = unix_ms();
  proto::StateChangeT change;
  change.state = "queued";
  change.at_ms = rec.submitted_ms;
  rec.history.push_back(change);
  uint64_t id = rec.id;
  jobs_.emplace(id, std::move(rec));
  return id;
}

JobRecord* JobTable::find(uint64_t id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

std::vector<JobRecord*> JobTable::queued() {
  std::vector<JobRecord*> out;
  for (auto& [id, j] : jobs_) {
    if (j.state == JobState::Queued) out.push_back(&j);
  }
  std::stable_sort(out.begin(), out.end(),
                   [](const JobRecord* a, const JobRecord* b) { return a->priority > b->priority; });
  return out;
}

void JobTable::set_state(JobRecord& job, JobState state, const std::string& reason) {
  job.state = state;
  if (!reason.empty()) job.reason = reason;
  proto::StateChangeT change;
  change.state = job_state_name(state);
  change.at_ms = unix_ms();
  change.reason = reason;
  job.history.push_back(change);
}

bool JobTable::apply(JobRecord& job, const proto::JobUpdate& u) {
  auto state = parse_job_state(u.state() ? u.state()->str() : "running");
  if (!state || *state == JobState::Queued || job.state != JobState::Running) return false;
  if (u.progress()) u.progress()->UnPackTo(&job.progress);
  if (u.epoch()) {
    proto::EpochStatT e;
    u.epoch()->UnPackTo(&e);
    job.epochs.push_back(e);
  }
  if (*state != JobState::Running) {
    job.test_accuracy = u.test_accuracy();
    job.samples_per_second = u.samples_per_second();
    set_state(job, *state, u.reason() ? u.reason()->str() : "");
  }
  return true;
}

std::vector<JobRecord*> JobTable::running_on(const std::string& agent) {
  std::vector<JobRecord*> out;
  for (auto& [id, j] : jobs_) {
    if (j.state == JobState::Running && j.agent == agent) out.push_back(&j);
  }
  return out;
}

}  // namespace leasehold
