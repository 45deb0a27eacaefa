// Device faults: a job's agent lost its GPU context (a kernel faulted, or
// under MPS any client's kernel did, or the MPS server went away). Which
// job caused a fault is known for sure only when it ran alone: under MPS
// every client on the GPU sees the same error at the same moment (measured
// on an H100: the faulting client and its neighbours all get
// cudaErrorIllegalAddress, and the driver's Xid names a neighbour's pid).
// So a fault shared by several jobs counts against none of them; they come
// back as suspects, and a suspect runs alone until it has shown it runs
// cleanly (an epoch reported, or fault_probation of training). A suspect
// that faults alone is the cause: that fault counts, and it stays a
// suspect (its next attempt runs alone too).
#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/core.h"

namespace leasehold {

void CoordinatorCore::on_device_fault(JobRecord& job, AgentRecord& agent, const std::string& reason,
                                      Now now, Effects& out) {
  ++device_faults_;
  const bool mps = !opts_.mps_pipe_directory.empty();
  // The reporting agent restarts; it gets no job meanwhile.
  agent.context_lost = true;
  agent.context_lost_since = now.steady;
  // One fault is reported by every job it ended, within a moment of each
  // other: the first report opens an incident holding the jobs that were
  // running then; a report of one of those (the same attempt) within
  // fault_window belongs to it. Anything else is a new fault.
  // Under MPS a fault ends the contexts of every client on its GPU (not on
  // the others): incidents are per device.
  const int device = agent.device;
  auto incident = incidents_.find(device);
  bool in_incident = false;
  if (incident != incidents_.end() && now.steady - incident->second.opened <= opts_.fault_window) {
    auto it = incident->second.jobs.find(job.id);
    in_incident = it != incident->second.jobs.end() && it->second == job.attempt_number();
  }
  if (!in_incident) {
    FaultIncident fresh{now.steady, {}};
    for (uint64_t id : jobs_.running()) {
      const JobRecord& other = *jobs_.find(id);
      if (id == job.id || device_of(other) == device) fresh.jobs[id] = other.attempt_number();
    }
    incident = incidents_.insert_or_assign(device, std::move(fresh)).first;
    if (mps) {
      // Under MPS every client's context on this GPU ended with it, busy or
      // idle: none gets a job until it has restarted (or, if it never
      // does, for twice fault_window: its context was not in this server
      // after all).
      for (auto& [name, a] : agents_) {
        if (a.device != device) continue;
        a.context_lost = true;
        a.context_lost_since = now.steady;
      }
    }
  }
  std::vector<uint64_t> beside;
  if (mps) {
    for (const auto& [id, attempt] : incident->second.jobs) {
      if (id != job.id) beside.push_back(id);
    }
  }
  const std::string what = reason.empty() ? "device fault on agent '" + agent.name + "'" : reason;
  if (beside.empty()) {
    // Its own: alone on the GPU (or each agent in a context of its own).
    // Under MPS it runs alone again, so a repeat takes nobody else along.
    const bool was_suspect = job.fault_suspect;
    set_suspect(job, mps);
    job.probation_since.reset();
    spdlog::warn("{}: device fault while it ran {}; counted against max_attempts", job_label(job),
                 mps ? "alone on the GPU" : "in its own GPU context");
    requeue(job, Interruption::DeviceFault,
            what + (was_suspect ? " (while it ran alone after a shared fault: its own)"
                    : mps       ? " (while it ran alone on the GPU)"
                                : ""),
            true, now, out, "device fault");
    return;
  }
  std::string others;
  for (uint64_t id : beside) others += (others.empty() ? "" : ", ") + std::to_string(id);
  spdlog::warn(
      "{}: device fault shared under MPS with job(s) {}; not counted, it runs alone "
      "next until it has run cleanly",
      job_label(job), others);
  set_suspect(job, true);
  job.probation_since.reset();
  requeue(job, Interruption::DeviceFault,
          what + " (under MPS, with job(s) " + others + " on the GPU: not counted)", false, now,
          out);
}

void CoordinatorCore::set_suspect(JobRecord& job, bool suspect) {
  job.fault_suspect = suspect;
  if (suspect) {
    suspects_.insert(job.id);
  } else {
    suspects_.erase(job.id);
  }
}

std::optional<int> CoordinatorCore::device_of(const JobRecord& job) const {
  auto it = agents_.find(job.agent);
  if (it == agents_.end() || it->second.job_id != job.id) return std::nullopt;
  return it->second.device;
}

CoordinatorCore::FaultRules CoordinatorCore::fault_rules() const {
  FaultRules r;
  if (opts_.mps_pipe_directory.empty()) return r;
  for (uint64_t id : jobs_.running()) {
    const JobRecord& job = *jobs_.find(id);
    // A running job whose agent is away (orphaned) may still be on any GPU.
    const std::optional<int> device = device_of(job);
    for (const auto& [ordinal, dev] : devices_) {
      if (device && *device != ordinal) continue;
      r.running.insert(ordinal);
      if (job.fault_suspect) r.suspect_running.insert(ordinal);
    }
  }
  for (uint64_t id : suspects_) r.suspect_queued |= jobs_.find(id)->state == JobState::Queued;
  r.active = true;
  return r;
}

bool CoordinatorCore::FaultRules::allow(const JobRecord& job, int device) const {
  if (!active) return true;
  if (suspect_running.count(device)) return false;       // nothing starts beside a suspect
  if (job.fault_suspect) return !running.count(device);  // a suspect starts only alone
  return !suspect_queued;  // the GPUs drain for waiting suspects (else they could starve)
}

bool CoordinatorCore::FaultRules::allow_anywhere(const JobRecord& job,
                                                 const std::map<int, DeviceState>& devices) const {
  for (const auto& [ordinal, dev] : devices) {
    if (allow(job, ordinal)) return true;
  }
  return false;
}

void CoordinatorCore::FaultRules::started(const JobRecord& job, int device) {
  running.insert(device);
  if (job.fault_suspect) suspect_running.insert(device);
}

void CoordinatorCore::end_probations(Now now, Effects& out) {
  bool cleared = false;
  const std::vector<uint64_t> suspects(suspects_.begin(), suspects_.end());
  for (uint64_t id : suspects) {
    JobRecord& job = *jobs_.find(id);
    if (job.state != JobState::Running || !job.probation_since) continue;
    if (now.steady - *job.probation_since < opts_.fault_probation) continue;
    set_suspect(job, false);
    job.probation_since.reset();
    cleared = true;
    spdlog::info("{}: ran alone for {} ms without a device fault; others may run beside it",
                 job_label(job), opts_.fault_probation.count());
  }
  // An agent marked after a fault that has not restarted within twice the
  // window was not in the faulted context (or noticed nothing): it works.
  for (auto& [name, agent] : agents_) {
    if (agent.context_lost && now.steady - agent.context_lost_since >= 2 * opts_.fault_window) {
      agent.context_lost = false;
      cleared = true;
      spdlog::info("agent '{}' did not restart after the device fault; it takes jobs again", name);
    }
  }
  if (cleared) schedule(now, out);
}

}  // namespace leasehold
