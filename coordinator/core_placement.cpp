// Which queued job starts where: queue order per device, the devices a job
// could ever run on, and the one the policy leaves the most room on
// (coordinator/occupancy.md, "Placement over several devices").
#include <algorithm>

#include "coordinator/core.h"

namespace leasehold {

void CoordinatorCore::schedule(Now now, Effects& out) {
  // A job some agent still runs or stops is not started anywhere else.
  std::set<uint64_t> held;
  for (const auto& [name, agent] : agents_) {
    for (const auto& r : agent.reported) {
      if (r.phase != proto::JobPhase::Reporting) held.insert(r.job_id);
    }
  }
  // Jobs start strictly in queue order per device: a job that waits (for
  // memory or an idle agent) blocks the devices it could run on for the
  // jobs behind it, so small jobs never starve a large one; a job for
  // other devices goes on. With no idle agent only the first in line is
  // looked at (to say why it waits).
  size_t idle = 0;
  for (const auto& [name, agent] : agents_) idle += agent.idle();
  // (Collected first: assigning a job takes it out of the queue.)
  std::vector<JobRecord*> candidates;
  for (const auto& key : jobs_.queue()) {
    JobRecord* job = jobs_.find(key.id);
    if (held.count(job->id) || !device_fits_any(job->device)) continue;
    candidates.push_back(job);
    if (idle == 0) break;  // only the first in line, to say why it waits
  }
  Pick refused;  // the latest refusal, for the job still first in line
  // Suspects of a shared device fault run alone (core_faults.cpp).
  FaultRules rules = fault_rules();
  std::set<int> blocked;
  std::vector<JobRecord*> waiting;
  for (JobRecord* job : candidates) {
    if (idle == 0 || blocked.size() == devices_.size()) {
      // Nothing more can start: the first waiting job is all that is noted.
      if (waiting.empty()) waiting.push_back(job);
      break;
    }
    if (!rules.allow_anywhere(*job, devices_)) {
      // The fault rules hold it back (and say which others may start).
      waiting.push_back(job);
      continue;
    }
    auto placed = place(*job, blocked, rules);
    if (placed.agents.empty()) {
      std::vector<int> usable;
      for (auto& [ordinal, dev] : devices_) {
        if (could_run_on(*job, dev)) usable.push_back(ordinal);
      }
      if (usable.size() >= static_cast<size_t>(job->replicas())) {
        if (waiting.empty() && !placed.refused.waiting_for.empty()) refused = placed.refused;
        blocked.insert(usable.begin(), usable.end());
      } else if (waiting.empty()) {
        // A gang that fits fewer devices than it has replicas (its budget
        // is larger than some pools, its parameters are resident on one
        // device) cannot start as things are: it holds no device for
        // itself, and says why it waits.
        refused = Pick{};
        refused.waiting_for = "waiting for " + std::to_string(job->replicas()) +
                              " devices it fits (memory_budget, device, init_from); " +
                              std::to_string(usable.size()) + " of this coordinator's do";
      }
      // Until it is placed, its shares are of the largest pool.
      note_shares(*job, largest_pool());
      waiting.push_back(job);
      continue;
    }
    if (waiting.empty()) refused = Pick{};
    // Every replica of a data-parallel job starts in this same turn, or
    // none does (place() found them all): nothing is held while waiting.
    for (AgentRecord* agent : placed.agents) {
      DeviceState& dev = device_of(*agent);
      note_shares(*job, dev.pool.size);
      evict_for_admission(dev, *job, now);
      rules.started(*job, dev.ordinal());
    }
    assign(*job, placed.agents, now, out);
    idle -= std::min(idle, placed.agents.size());
  }
  note_waiting(waiting.empty() ? nullptr : waiting.front(), refused, now, out);
  for (JobRecord* job : waiting) {
    if (rules.allow_anywhere(*job, devices_)) continue;
    std::string why = job->fault_suspect
                          ? "runs alone on the GPU after a shared device fault; waiting for "
                            "the running jobs to end"
                          : "waiting while jobs suspected of a device fault run alone";
    if (why != job->waiting_for) {
      job->waiting_for = std::move(why);
      out.events.push_back(job->id);
    }
  }
}

bool CoordinatorCore::could_run_on(JobRecord& job, const DeviceState& dev) const {
  if (!device_fits(job.device, dev)) return false;
  // Its budget and guaranteed share, resolved against this pool, fit it
  // (a job validated against a larger device may not fit a smaller one).
  note_shares(job, dev.pool.size);
  if (job.budget_bytes > dev.pool.size || job.guaranteed_bytes > dev.pool.size) return false;
  // A job starting from a parameter region that is resident goes where
  // it is: regions are per device.
  if (job.spec && !job.spec->init_from.empty()) {
    const std::string region = "params/" + job.spec->init_from;
    bool elsewhere = false;
    for (const auto& [ordinal, other] : devices_) {
      const RegionRecord* r = other.regions.find(region);
      const bool ready = r && r->state == RegionState::Ready;
      if (ready && ordinal == dev.ordinal()) return true;
      elsewhere |= ready;
    }
    if (elsewhere) return false;
  }
  return true;
}

CoordinatorCore::Placement CoordinatorCore::place(JobRecord& job, const std::set<int>& blocked,
                                                  const FaultRules& rules) {
  // Of the devices the job may run on (its pin, the backend, its sizes, a
  // region it starts from; the fault rules) and not held for a job before
  // it, with an idle agent: the one where the policy admits it with the
  // most room left afterwards, so that jobs spread over the GPUs
  // (coordinator/occupancy.md says why); the fewest running jobs, then the
  // lowest ordinal, on a tie. A data-parallel job takes the best `replicas`
  // such devices, one replica each, or none at all.
  struct Candidate {
    AgentRecord* agent;
    uint64_t room;
    size_t running;
    int ordinal;
  };
  std::vector<Candidate> candidates;
  Placement best;
  for (auto& [ordinal, dev] : devices_) {
    if (blocked.count(ordinal) || !rules.allow(job, ordinal) || !could_run_on(job, dev)) continue;
    AgentRecord* agent = nullptr;
    size_t running = 0;
    for (auto& [name, a] : agents_) {
      if (a.device != ordinal) continue;
      running += a.job_id != 0;
      if (!agent && a.idle()) agent = &a;
    }
    if (!agent) continue;
    note_shares(job, dev.pool.size);
    const PoolView view = pool_view(dev);
    JobRecord* one[] = {&job};
    Pick pick = policy_->pick_job(*agent, one, view);
    if (!pick.job) {
      if (best.refused.waiting_for.empty()) best.refused = std::move(pick);
      continue;
    }
    const uint64_t committed = view.used + view.reserved() + job.guaranteed_bytes;
    const uint64_t room = view.pool_size > committed ? view.pool_size - committed : 0;
    candidates.push_back({agent, room, running, ordinal});
  }
  const size_t wanted = static_cast<size_t>(job.replicas());
  if (candidates.size() < wanted) {
    if (wanted > 1 && best.refused.waiting_for.empty()) {
      best.refused.waiting_for = "waiting for " + std::to_string(wanted) +
                                 " devices with an idle agent and room for a replica (" +
                                 std::to_string(candidates.size()) + " now)";
    }
    return best;
  }
  std::sort(candidates.begin(), candidates.end(), [](const Candidate& a, const Candidate& b) {
    if (a.room != b.room) return a.room > b.room;
    if (a.running != b.running) return a.running < b.running;
    return a.ordinal < b.ordinal;
  });
  candidates.resize(wanted);
  // Ranks follow the device ordinals.
  std::sort(candidates.begin(), candidates.end(),
            [](const Candidate& a, const Candidate& b) { return a.ordinal < b.ordinal; });
  for (const auto& c : candidates) best.agents.push_back(c.agent);
  best.refused = Pick{};
  return best;
}

}  // namespace leasehold
