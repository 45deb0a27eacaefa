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

void CoordinatorCore::on_device_fault(JobRecord& job, const AgentRecord& agent,
                                      const std::string& reason, Now now, Effects& out) {
  ++device_faults_;
  const bool mps = !opts_.mps_pipe_directory.empty();
  std::erase_if(recent_faults_, [&](const auto& f) {
    return now.steady - f.first > opts_.fault_window;
  });
  // Who else this fault may belong to: jobs that are running now (their
  // agents will report it in a moment), or that reported one just now.
  std::vector<uint64_t> beside;
  if (mps) {
    for (const auto& [id, other] : jobs_.all()) {
      if (id != job.id && other.state == JobState::Running) beside.push_back(id);
    }
    for (const auto& [when, id] : recent_faults_) {
      if (id != job.id && std::find(beside.begin(), beside.end(), id) == beside.end()) {
        beside.push_back(id);
      }
    }
  }
  if (mps && recent_faults_.empty()) {
    // The first report of this fault: every agent registered before it is
    // an MPS client whose context ended too, busy or idle. None of them
    // gets a job until it has restarted and registered afresh (a job given
    // to one would fail at once and look like its own fault).
    for (auto& [name, a] : agents_) {
      a.context_lost = true;
    }
  }
  recent_faults_.emplace_back(now.steady, job.id);
  const std::string what = reason.empty() ? "device fault on agent '" + agent.name + "'" : reason;
  if (beside.empty()) {
    // Its own: alone on the GPU (or each agent in a context of its own).
    // Under MPS it runs alone again, so a repeat takes nobody else along.
    const bool was_suspect = job.fault_suspect;
    job.fault_suspect = mps;
    job.probation_since.reset();
    spdlog::warn("{}: device fault while it ran {}; counted against max_attempts",
                 job_label(job), mps ? "alone on the GPU" : "in its own GPU context");
    requeue(job,
            what + (was_suspect ? " (while it ran alone after a shared fault: its own)"
                                : mps ? " (while it ran alone on the GPU)" : ""),
            true, now, out, "device fault");
    return;
  }
  std::string others;
  for (uint64_t id : beside) others += (others.empty() ? "" : ", ") + std::to_string(id);
  spdlog::warn("{}: device fault shared under MPS with job(s) {}; not counted, it runs alone "
               "next until it has run cleanly",
               job_label(job), others);
  job.fault_suspect = true;
  job.probation_since.reset();
  requeue(job, what + " (under MPS, with job(s) " + others + " on the GPU: not counted)", false,
          now, out);
}

bool CoordinatorCore::fault_rules_allow(const JobRecord& job) const {
  if (opts_.mps_pipe_directory.empty()) return true;
  bool running = false;
  for (const auto& [id, other] : jobs_.all()) {
    if (other.state != JobState::Running) continue;
    if (other.fault_suspect) return false;  // nothing starts beside a suspect
    running = true;
  }
  return !job.fault_suspect || !running;  // a suspect starts only alone
}

void CoordinatorCore::end_probations(Now now, Effects& out) {
  bool cleared = false;
  for (auto& [id, job] : jobs_.all()) {
    if (!job.fault_suspect || job.state != JobState::Running || !job.probation_since) continue;
    if (now.steady - *job.probation_since < opts_.fault_probation) continue;
    job.fault_suspect = false;
    job.probation_since.reset();
    cleared = true;
    spdlog::info("{}: ran alone for {} ms without a device fault; others may run beside it",
                 job_label(job), opts_.fault_probation.count());
  }
  if (cleared) schedule(now, out);
}

}  // namespace leasehold
