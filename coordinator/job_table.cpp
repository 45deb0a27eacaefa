#include "coordinator/job_table.h"

#include <algorithm>

#include "shared/printable.h"

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

int32_t JobRecord::last_checkpoint_epoch() const {
  for (auto it = epochs.rbegin(); it != epochs.rend(); ++it) {
    if (it->checkpointed) return it->epoch;
  }
  return 0;
}

JobRecord& JobTable::add(std::shared_ptr<const proto::JobSpecT> spec, uint64_t now_ms) {
  JobRecord rec;
  rec.id = next_id_++;
  rec.name = spec->name;
  rec.priority = spec->priority;
  rec.device = spec->device.empty() ? "auto" : spec->device;
  rec.max_attempts = spec->max_attempts;
  rec.spec = std::move(spec);
  rec.submitted_ms = now_ms;
  proto::StateChangeT change;
  change.state = "queued";
  change.at_ms = now_ms;
  rec.history.push_back(change);
  uint64_t id = rec.id;
  return jobs_.emplace(id, std::move(rec)).first->second;
}

void JobTable::restore(JobRecord job) {
  raise_next_id(job.id + 1);
  uint64_t id = job.id;
  jobs_[id] = std::move(job);
}

JobRecord* JobTable::find(uint64_t id) {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

const JobRecord* JobTable::find(uint64_t id) const {
  auto it = jobs_.find(id);
  return it == jobs_.end() ? nullptr : &it->second;
}

void JobTable::erase(uint64_t id) { jobs_.erase(id); }

std::vector<JobRecord*> JobTable::queued() {
  std::vector<JobRecord*> out;
  for (auto& [id, j] : jobs_) {
    if (j.state == JobState::Queued) out.push_back(&j);
  }
  // jobs_ is in id order, which is submission order; stable keeps it.
  std::stable_sort(out.begin(), out.end(),
                   [](const JobRecord* a, const JobRecord* b) { return a->priority > b->priority; });
  return out;
}

void JobTable::set_state(JobRecord& job, JobState state, uint64_t now_ms,
                         const std::string& reason) {
  job.state = state;
  if (state != JobState::Queued) {
    job.waiting_for.clear();
    job.waiting_since.reset();
  }
  // The job's reason says why it is queued again or why it ended; a running
  // job keeps the one it had ("coordinator restarted; resuming ...").
  const std::string bounded = printable(reason, kReasonBytes);
  if (!bounded.empty() && state != JobState::Running) job.reason = bounded;
  if (is_terminal(state)) job.finished_ms = now_ms;
  proto::StateChangeT change;
  change.state = job_state_name(state);
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
