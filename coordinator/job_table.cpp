#include "coordinator/job_table.h"

#include <algorithm>

#include "shared/printable.h"

namespace leasehold {

const char* job_state_name(JobState s) {
  switch (s) {
    case JobState::Queued:
      return "queued";
    case JobState::Running:
      return "running";
    case JobState::Succeeded:
      return "succeeded";
    case JobState::Failed:
      return "failed";
    case JobState::Cancelled:
      return "cancelled";
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

proto::JobStatus job_status(JobState s) {
  switch (s) {
    case JobState::Queued:
      return proto::JobStatus::Queued;
    case JobState::Running:
      return proto::JobStatus::Running;
    case JobState::Succeeded:
      return proto::JobStatus::Succeeded;
    case JobState::Failed:
      return proto::JobStatus::Failed;
    case JobState::Cancelled:
      return proto::JobStatus::Cancelled;
  }
  return proto::JobStatus::Unset;
}

std::optional<JobState> job_state_of(proto::JobStatus s) {
  switch (s) {
    case proto::JobStatus::Queued:
      return JobState::Queued;
    case proto::JobStatus::Running:
      return JobState::Running;
    case proto::JobStatus::Succeeded:
      return JobState::Succeeded;
    case proto::JobStatus::Failed:
      return JobState::Failed;
    case proto::JobStatus::Cancelled:
      return JobState::Cancelled;
    default:
      return std::nullopt;
  }
}

int32_t JobRecord::last_checkpoint_epoch() const {
  for (auto it = epochs.rbegin(); it != epochs.rend(); ++it) {
    if (it->checkpointed) return it->epoch;
  }
  return 0;
}

int JobRecord::rank_on(const std::string& name) const {
  if (name.empty()) return -1;
  if (agent == name) return 0;
  if (attempts.empty()) return -1;
  const auto& r = attempts.back().replica_agents;
  auto it = std::find(r.begin(), r.end(), name);
  return it == r.end() ? -1 : static_cast<int>(it - r.begin()) + 1;
}

std::vector<std::string> JobRecord::gang() const {
  std::vector<std::string> all{agent};
  if (!attempts.empty()) {
    const auto& r = attempts.back().replica_agents;
    all.insert(all.end(), r.begin(), r.end());
  }
  return all;
}

JobRecord& JobTable::add(std::shared_ptr<const proto::JobSpecT> spec, uint64_t now_ms,
                         std::optional<uint32_t> submitted_uid, std::string submitted_by) {
  JobRecord rec;
  rec.submitted_uid = submitted_uid;
  rec.submitted_by = std::move(submitted_by);
  rec.waiting_for = kBehind;
  rec.id = next_id_++;
  rec.name = spec->name;
  rec.priority = spec->priority;
  rec.device = spec->device.empty() ? "auto" : spec->device;
  rec.max_attempts = spec->max_attempts;
  rec.spec = std::move(spec);
  rec.submitted_ms = now_ms;
  proto::StateChangeT change;
  change.status = proto::JobStatus::Queued;
  change.at_ms = now_ms;
  rec.history.push_back(change);
  uint64_t id = rec.id;
  JobRecord& job = jobs_.emplace(id, std::move(rec)).first->second;
  index(job);
  return job;
}

void JobTable::restore(JobRecord job) {
  raise_next_id(job.id + 1);
  uint64_t id = job.id;
  if (auto it = jobs_.find(id); it != jobs_.end()) unindex(it->second);
  if (job.state == JobState::Queued && job.waiting_for.empty()) job.waiting_for = kBehind;
  JobRecord& stored = jobs_[id] = std::move(job);
  index(stored);
}

void JobTable::index(const JobRecord& job) {
  ++by_state_[static_cast<size_t>(job.state)];
  if (job.state == JobState::Queued) {
    queue_.insert({job.priority, job.id});
    ++queued_by_[job.submitter()];
  } else if (job.state == JobState::Running) {
    running_.insert(job.id);
  }
}

void JobTable::unindex(const JobRecord& job) {
  --by_state_[static_cast<size_t>(job.state)];
  if (job.state == JobState::Queued) {
    queue_.erase({job.priority, job.id});
    auto it = queued_by_.find(job.submitter());
    if (it != queued_by_.end() && --it->second == 0) queued_by_.erase(it);
  } else if (job.state == JobState::Running) {
    running_.erase(job.id);
  }
}

uint32_t JobTable::queued_by(const std::string& submitter) const {
  auto it = queued_by_.find(submitter);
  return it == queued_by_.end() ? 0 : it->second;
}

JobRecord* JobTable::find(uint64_t id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

const JobRecord* JobTable::find(uint64_t id) const {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

void JobTable::erase(uint64_t id) {
  auto it = jobs_.find(id);
  if (it == jobs_.end()) return;
  unindex(it->second);
  jobs_.erase(it);
}

void JobTable::set_state(JobRecord& job, JobState state, uint64_t now_ms,
                         const std::string& reason) {
  unindex(job);
  job.state = state;
  index(job);
  if (state != JobState::Queued) {
    job.waiting_for.clear();
    job.waiting_since.reset();
  } else {
    job.waiting_for = kBehind;  // until the scheduler finds it first in line
  }
  // The job's reason says why it is queued again or why it ended; a running
  // job keeps the one it had ("coordinator restarted; resuming ...").
  const std::string bounded = printable(reason, kReasonBytes);
  if (!bounded.empty() && state != JobState::Running) job.reason = bounded;
  if (is_terminal(state)) job.finished_ms = now_ms;
  proto::StateChangeT change;
  change.status = job_status(state);
  change.at_ms = now_ms;
  change.reason = bounded;
  job.history.push_back(change);
  if (job.history.size() > history_kept_) {
    const size_t drop = job.history.size() - history_kept_;
    job.history.erase(job.history.begin(), job.history.begin() + static_cast<std::ptrdiff_t>(drop));
    job.history_dropped += static_cast<uint32_t>(drop);
  }
}

}  // namespace leasehold
