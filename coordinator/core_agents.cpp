// The core's agents: registration (who may take which name), the jobs an
// agent lists, and an agent's end (unregistered, silent, dead) with the
// fences that hold its leases while it may still write.
#include <spdlog/spdlog.h>

#include <cctype>

#include "coordinator/core.h"
#include "coordinator/replies.h"
#include "shared/printable.h"
#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold {
namespace {

constexpr size_t kMaxNameLength = 128;

// An agent runs one job at a time, and may still be reporting or stopping
// the one before: a list longer than this is not an agent's (each entry
// could cost a StopJob and a log line).
constexpr size_t kMaxReportedJobs = 8;

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == '@' || c == ':')) {
      return false;
    }
  }
  return true;
}

}  // namespace

std::optional<std::string> CoordinatorCore::reported_jobs_refusal(
    const flatbuffers::Vector<flatbuffers::Offset<proto::AgentJob>>* jobs) {
  if (!jobs || jobs->size() <= kMaxReportedJobs) return std::nullopt;
  return "the message lists " + std::to_string(jobs->size()) + " jobs; an agent runs at most " +
         std::to_string(kMaxReportedJobs);
}

void CoordinatorCore::on_register(const std::string& rid, const proto::Envelope& env, Now now,
                                  Effects& out, const Peer& peer) {
  const auto* r = env.body_as_Register();
  uint64_t req = env.header()->request_id();
  if (auto refusal = opts_.access.check(Role::Agent, peer)) {
    spdlog::warn("refused an agent registration: {}", *refusal);
    return send_error(out, rid, req, ErrorCode::PermissionDenied, *refusal);
  }
  std::string name(str(r->name()));
  if (!valid_name(name)) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "agent name '" + printable(name, kMaxNameLength) +
                          "' is invalid: use 1-128 letters, digits, '-', '_', '.', '@' or ':'");
  }
  if (auto no = reported_jobs_refusal(r->jobs())) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument, *no);
  }
  if (r->pid() <= 0) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "pid " + std::to_string(r->pid()) + " is invalid");
  }
  const SessionToken instance{r->instance_lo(), r->instance_hi()};
  const std::string identity = peer.identity();
  int wanted_device = r->device();
  if (r->job_id() != 0) {
    if (auto no = program_session_refusal(*r, name, identity)) {
      spdlog::warn("refused the session of program job {}: {}", r->job_id(), *no);
      return send_error(out, rid, req, ErrorCode::PermissionDenied, *no);
    }
    // A program's memory is its job's, on the device its agent works on.
    const JobRecord& job = *jobs_.find(r->job_id());
    // (The session is named after the agent running its replica.)
    const std::string runner_name = name.substr(0, name.rfind(":job"));
    auto runner = agents_.find(runner_name);
    if (runner == agents_.end()) {
      return send_error(out, rid, req, ErrorCode::UnknownSender,
                        "program job " + std::to_string(job.id) + "'s agent '" + runner_name +
                            "' is not registered (yet): register again once it is");
    }
    const int job_device = runner->second.device;
    if (wanted_device >= 0 && wanted_device != job_device) {
      return send_error(out, rid, req, ErrorCode::InvalidArgument,
                        "program job " + std::to_string(job.id) + " runs on device " +
                            std::to_string(job_device) + ", not device " +
                            std::to_string(wanted_device));
    }
    wanted_device = job_device;
  }
  // A name whose job waits for its agent to come back (the coordinator
  // restarted, the agent lost its session) is that agent's: another user's
  // agent taking it could claim the job.
  for (uint64_t id : jobs_.running()) {
    const JobRecord& job = *jobs_.find(id);
    if (job.orphaned_since && job.agent == name && !job.attempts.empty() &&
        !job.attempts.back().agent_identity.empty() &&
        job.attempts.back().agent_identity != identity) {
      return send_error(out, rid, req, ErrorCode::NameTaken,
                        "agent name '" + name + "' belongs to another user's agent, whose job " +
                            std::to_string(id) + " waits for it to come back");
    }
  }
  if (auto it = agents_.find(name); it != agents_.end()) {
    const AgentRecord& old = it->second;
    // Never taken over by what anyone can read (a pid `leasehold status`
    // shows): only the holder's own instance, which only it knows, or the
    // session token it was given.
    const bool same_process = !instance.empty() && old.instance == instance;
    const bool proves_session =
        old.session == SessionToken{env.header()->session(), env.header()->session_hi()};
    if (same_process || proves_session) {
      // The same agent registering again lost its session (for example a
      // reply that never reached it): its old leases are void, and its job
      // waits for what it reports below.
      drop_agent(name, "registered again", JobFate::Orphan, now, out);
    } else if (gone(old.process)) {
      drop_agent(name, "replaced: its process is gone", JobFate::AgentLost, now, out);
    } else {
      return send_error(out, rid, req, ErrorCode::NameTaken,
                        "agent name '" + name + "' is in use by live pid " +
                            std::to_string(old.pid) +
                            " (a restart of that agent registers once its old session ends)");
    }
    serve_waiting(out);
  }
  if (auto f = fences_.find(name); f != fences_.end()) {
    // Its fenced leases stay its own, on their device, until it says it
    // holds none of them: it works on that device meanwhile.
    if (wanted_device >= 0 && wanted_device != f->second.device) {
      return send_error(out, rid, req, ErrorCode::InvalidArgument,
                        "agent '" + name + "' still has leases fenced on device " +
                            std::to_string(f->second.device) +
                            " from an earlier session: it registers there until they are "
                            "released (its old process exits)");
    }
    wanted_device = f->second.device;
  }
  // An agent registering again without --device goes back to its device.
  if (wanted_device == -1 && devices_.count(r->preferred_device())) {
    wanted_device = r->preferred_device();
  }
  auto bound = bind_device(wanted_device, r->takes_jobs() && r->job_id() == 0);
  if (auto* no = std::get_if<std::string>(&bound)) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument, *no);
  }
  AgentRecord& rec = agents_[name];
  rec.name = name;
  rec.pid = r->pid();
  rec.process = peer.known && peer.pid > 0 ? opts_.follow_process(peer) : nullptr;
  rec.stale_holds = r->stale_holds();
  rec.identity = identity;
  rec.device = std::get<int>(bound);
  rec.session = SessionToken::random();
  rec.instance = instance;
  rec.routing_ids.insert(rid);
  rec.takes_jobs = r->takes_jobs() && r->job_id() == 0;
  rec.program_job = r->job_id();
  rec.program_attempt = r->attempt();
  if (rec.program_job) program_sessions_.emplace(rec.program_job, name);
  rec.ready = r->ready();
  rec.outside_pool_bytes = r->outside_pool_bytes();
  rec.mps_thread_percentage = r->mps_thread_percentage();
  rec.last_seen = now.steady + opts_.first_heartbeat_grace;
  spdlog::info("agent '{}' (pid {}) registered on device {}{}; {}", name, rec.pid, rec.device,
               rec.takes_jobs && !rec.ready ? " (warming up)" : "", summary());

  proto::RegisterAckT ack;
  ack.session = rec.session.lo;
  ack.session_hi = rec.session.hi;
  ack.heartbeat_interval_ms = static_cast<uint32_t>(opts_.heartbeat_interval.count());
  ack.pool = pool_info_object(device_of(rec).pool);
  ack.default_wait_ms = static_cast<uint32_t>(opts_.lease_wait_timeout.count());
  ack.mps_pipe_directory = opts_.mps_pipe_directory;
  ack.silence_limit_ms = static_cast<uint32_t>(silence_limit().count());
  ack.coordinator_instance_lo = instance_.lo;
  ack.coordinator_instance_hi = instance_.hi;
  ack.chunk_socket = opts_.chunk_socket;
  send(out, rid, req, std::move(ack));
  // What it still runs from an earlier session; then it may take a job.
  reconcile(rec, r, nullptr, now, out);
  schedule(now, out);
}

std::variant<int, std::string> CoordinatorCore::bind_device(int wanted, bool takes_jobs) const {
  if (wanted >= 0) {
    if (devices_.count(wanted)) return wanted;
    std::string served;
    for (const auto& [ordinal, dev] : devices_) {
      served += (served.empty() ? "" : ", ") + std::to_string(ordinal);
    }
    return "agent wants device " + std::to_string(wanted) + " but this coordinator serves device" +
           (devices_.size() > 1 ? "s " : " ") + served;
  }
  if (wanted != -1) return "device " + std::to_string(wanted) + " is not an ordinal (or -1: any)";
  // Any: the device with the fewest agents of its kind (workers that take
  // jobs, or leasing clients), so that agents started without --device
  // spread over the GPUs; the lowest ordinal on a tie.
  int best = devices_.begin()->first;
  size_t fewest = SIZE_MAX;
  for (const auto& [ordinal, dev] : devices_) {
    size_t n = 0;
    for (const auto& [name, agent] : agents_) {
      n += agent.device == ordinal && agent.takes_jobs == takes_jobs;
    }
    if (n < fewest) {
      fewest = n;
      best = ordinal;
    }
  }
  return best;
}

void CoordinatorCore::drop_agent(const std::string& name, const std::string& why, JobFate fate,
                                 Now now, Effects& out) {
  auto it = agents_.find(name);
  if (it == agents_.end()) return;
  uint64_t job_id = it->second.job_id;
  const int pid = it->second.pid;
  const std::shared_ptr<AgentProcess> process = it->second.process;
  const bool renew = it->second.program_job != 0;
  std::erase_if(program_sessions_, [&](const auto& kv) { return kv.second == name; });
  bool fence = fate == JobFate::Orphan || fate == JobFate::Silent;
  DeviceState& dev = device_of(it->second);
  agents_.erase(it);
  // Its attachments go; a region it was filling goes with its leases.
  const std::vector<std::string> discarded = drop_region_users(dev, name, now);
  if (fence) {
    // Its kernels or loops may still write into these: nobody gets them
    // until its process has exited, or it registers again and says it
    // holds none of them. A fence already held for it (an earlier silence)
    // takes these too and keeps its start. (An agent's leases are all on
    // its device; one registering again is bound to the same device while
    // its fence holds, bind_device.)
    auto [count, bytes] =
        dev.leases.transfer_all(LeaseOwner::agent(name), LeaseOwner::fenced(name));
    if (count > 0 && !fences_.count(name)) {
      fences_[name] = Fence{dev.ordinal(), process, pid, now.steady, Fence::End::Waiting, {}, renew};
    } else if (count > 0) {
      fences_[name].renew = fences_[name].renew || renew;
    }
    spdlog::info("agent '{}' (pid {}) {}; {} leases ({}) fenced until it stops", name, pid, why,
                 count, format_bytes(bytes));
  } else {
    auto [count, bytes] =
        std::get<std::pair<size_t, uint64_t>>(give_back(dev, LeaseOwner::agent(name), renew, name));
    spdlog::info("agent '{}' (pid {}) {}; reclaimed {} leases ({}){}", name, pid, why, count,
                 format_bytes(bytes), renew && count ? ", free once their chunks have new memory" : "");
    release_fence(name, "the agent is gone", out);
  }
  for (const auto& region : discarded) {
    discard_region(dev, region, "its filler, agent '" + name + "', " + why, now, out);
  }
  JobRecord* job = job_id ? jobs_.find(job_id) : nullptr;
  const int rank = job ? job->rank_on(name) : -1;
  if (!job || job->state != JobState::Running || rank < 0) return;
  if (rank > 0 && static_cast<size_t>(rank) <= job->replicas_succeeded.size() &&
      job->replicas_succeeded[rank - 1]) {
    return;  // its part was done and reported: the gang does not need it any more
  }
  if (job->replicas() > 1) {
    // One replica lost is the whole gang's attempt: the others cannot go
    // on without it (their collectives would wait for it), so they stop
    // and the job resumes from its checkpoint as one attempt.
    const bool counts = fate == JobFate::AgentLost || fate == JobFate::Silent;
    const Interruption cause = fate == JobFate::AgentLost ? Interruption::AgentDied
                               : fate == JobFate::Silent  ? Interruption::AgentSilent
                               : fate == JobFate::Orphan  ? Interruption::SessionLost
                                                          : Interruption::AgentLeft;
    requeue(*job, cause, "agent '" + name + "' of replica " + std::to_string(rank) + " " + why,
            counts, now, out);
    return;
  }
  if (fence) {
    // Its report on registering again decides (reconcile), or the wait ends.
    job->orphaned_since = now.steady;
    job->orphan_counts = fate == JobFate::Silent;
    job->orphan_kind =
        fate == JobFate::Silent ? Interruption::AgentSilent : Interruption::SessionLost;
    job->orphan_process = fate == JobFate::Silent ? process : nullptr;
    return;
  }
  requeue(*job, fate == JobFate::AgentLost ? Interruption::AgentDied : Interruption::AgentLeft,
          "agent '" + name + "' " + why, fate == JobFate::AgentLost, now, out);
}

void CoordinatorCore::release_fence(const std::string& agent, const std::string& why,
                                    Effects& out) {
  auto it = fences_.find(agent);
  if (it == fences_.end()) return;
  DeviceState& dev = devices_.at(it->second.device);
  auto [count, bytes] = std::get<std::pair<size_t, uint64_t>>(
      give_back(dev, LeaseOwner::fenced(agent), it->second.renew, agent));
  spdlog::info("released {} fenced leases ({}) of agent '{}': {}", count, format_bytes(bytes),
               agent, why);
  fences_.erase(it);
  serve_waiting(dev, out);
}

void CoordinatorCore::check_fences(Now now, Effects& out) {
  std::vector<std::string> exited;
  for (auto& [agent, f] : fences_) {
    if (gone(f.process)) {
      exited.push_back(agent);
      continue;
    }
    // Registered again: its reports decide (reconcile), not the clock.
    if (f.end != Fence::End::Waiting || agents_.count(agent) ||
        now.steady - f.since < opts_.recovery_grace) {
      continue;
    }
    if (!f.process) {
      f.end = Fence::End::Held;
      f.why_held = "a network agent, whose process the coordinator cannot follow";
    } else if (!opts_.end_silent_agents) {
      f.end = Fence::End::Held;
      f.why_held = "end_silent_agents is off";
    } else if (std::string why = f.process->end(); !why.empty()) {
      f.end = Fence::End::Held;
      f.why_held = "it cannot be ended: " + why;
    } else {
      f.end = Fence::End::Killed;
    }
    const std::string silent = "agent '" + agent + "' (pid " + std::to_string(f.pid) +
                               ") is silent " + std::to_string(ms_between(f.since, now.steady)) +
                               " ms after its leases were fenced, and its process lives";
    if (f.end == Fence::End::Killed) {
      spdlog::warn(
          "{}: sent it SIGKILL (end_silent_agents); its fenced leases go back once it "
          "has exited",
          silent);
    } else {
      spdlog::warn("{}: its fenced leases stay held until it exits or registers again ({})", silent,
                   f.why_held);
    }
  }
  for (const auto& agent : exited) release_fence(agent, "its process has exited", out);
}

std::string CoordinatorCore::fence_state(const std::string& agent, const Fence& f, Now now) const {
  if (agents_.count(agent)) return "registered again; held until it holds none of it";
  switch (f.end) {
    case Fence::End::Killed:
      return "killed; held until its process has exited";
    case Fence::End::Held:
      return "held until its process exits or it registers again: " + f.why_held;
    case Fence::End::Waiting:
      break;
  }
  return "silent, its process may still write; " +
         std::string(opts_.end_silent_agents ? "ended" : "checked again") + " in " +
         std::to_string(ms_between(now.steady, f.since + opts_.recovery_grace)) + " ms";
}

void CoordinatorCore::purge_dead_agents(Now now, Effects& out) {
  struct Dead {
    std::string name;
    std::string why;
    JobFate fate;
  };
  std::vector<Dead> dead;
  for (auto& [name, agent] : agents_) {
    // last_seen is in the future while an agent is within its
    // first-heartbeat grace: silent by right, unless its process is gone.
    const auto silent = now.steady - agent.last_seen;
    const std::string quiet =
        silent.count() > 0
            ? "no message for " + std::to_string(ms_between(agent.last_seen, now.steady)) + " ms"
            : "within its first-heartbeat grace";
    if (gone(agent.process)) {
      // The kernel says it has exited: nothing of it can write any more.
      dead.push_back(
          {name, "declared dead (its process has exited; " + quiet + ")", JobFate::AgentLost});
    } else if (silent > stopped_limit() && agent.process && agent.process->stopped()) {
      dead.push_back({name, "silent (" + quiet + ") and its process is stopped", JobFate::Silent});
    } else if (silent > silence_limit()) {
      dead.push_back({name,
                      "silent (" + quiet + ") " +
                          (agent.process ? "while its process lives"
                                         : "(a process the coordinator cannot see)"),
                      JobFate::Silent});
    } else if (silent > stopped_limit() && !agent.late) {
      // A live process on a busy host, or one the coordinator cannot see:
      // it keeps its session until silence_limit.
      agent.late = true;
      spdlog::info("agent '{}' is late ({}); its session holds until {} ms of silence", name, quiet,
                   silence_limit().count());
    }
  }
  // Drop every dead agent before anything is scheduled again, so that no
  // job goes to an agent that is about to be dropped in the same turn.
  for (const auto& d : dead) {
    spdlog::warn("agent '{}' {}", d.name, d.why);
    drop_agent(d.name, d.why, d.fate, now, out);
  }
  if (!dead.empty()) serve_waiting(out);
}

void CoordinatorCore::stalled(Clock::duration gap, Now now) {
  if (gap <= Clock::duration::zero()) return;
  // Not past now: an agent heard during the stall's catching up was heard
  // then. (An agent in its first-heartbeat grace keeps its later end.)
  auto credit = [&](Clock::time_point& t) {
    if (t < now.steady) t = std::min(t + gap, now.steady);
  };
  for (auto& [name, agent] : agents_) {
    credit(agent.last_seen);
    if (agent.shrink) agent.shrink->deadline += gap;
  }
  for (auto& [name, f] : fences_) credit(f.since);
  // Every other clock that runs against an agent or a waiting request.
  for (uint64_t id : jobs_.running()) {
    JobRecord& job = *jobs_.find(id);
    for (auto* t :
         {&job.orphaned_since, &job.assigned_steady, &job.cancel_since, &job.probation_since}) {
      if (*t) **t += gap;
    }
    job.assign_sent += gap;
    job.stop_sent += gap;
  }
  for (auto& [ordinal, dev] : devices_) {
    dev.leases.postpone_deadlines(gap);
    for (auto& w : dev.regions.waiters()) w.deadline += gap;
  }
  for (auto& [token, p] : pending_submits_) p.deadline += gap;
  for (auto& [token, p] : pending_reads_) p.deadline += gap;
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(gap);
  if (ms >= opts_.heartbeat_interval) {
    spdlog::warn(
        "the coordinator did not run for {} ms (stopped, starved of CPU or stalled on "
        "its disk); agents' silence during it is not counted",
        ms.count());
  } else {
    spdlog::debug("the coordinator's loop was {} ms late; not counted as agents' silence",
                  ms.count());
  }
}

}  // namespace leasehold
