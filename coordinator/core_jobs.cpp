// The core's jobs: submission (after the file checks), listing,
// cancellation, assignment with acknowledgement, what agents report,
// requeueing after a lost agent or a restart, retention.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/core.h"
#include "coordinator/job_codec.h"
#include "coordinator/replies.h"
#include "shared/protocol.h"
#include "shared/job_spec.h"

namespace leasehold {
namespace {

bool device_fits(const std::string& job_device, Backend pool) {
  if (job_device == "cuda") return pool == Backend::Cuda;
  if (job_device == "cpu") return pool == Backend::Host;
  return true;
}

bool active(proto::JobPhase p) {
  return p == proto::JobPhase::Queued || p == proto::JobPhase::Running;
}

std::string job_label(const JobRecord& job) {
  return "job " + std::to_string(job.id) + " '" + job.name + "'";
}

}  // namespace

void CoordinatorCore::changed(const JobRecord& job, Effects& out) {
  out.store_puts.insert(job.id);
  out.events.push_back(job.id);
}

// ---- Submission ----

void CoordinatorCore::on_submit(const std::string& rid, const proto::Envelope& env, Now now,
                                Effects& out) {
  uint64_t req = env.header()->request_id();
  const auto* submit = env.body_as_SubmitJob();
  if (!submit->spec()) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument, "SubmitJob without a spec");
  }
  if (!store_error_.empty()) {
    return send_error(out, rid, req, ErrorCode::Internal,
                      "not accepting jobs: the job store cannot commit (" + store_error_ + ")");
  }
  auto spec = std::shared_ptr<proto::JobSpecT>(submit->spec()->UnPack());
  try {
    // Everything but the files here; the files are checked off this thread.
    validate_job(*spec, ValidationOptions{false, pool_.size});
  } catch (const JobSpecError& e) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument, e.what());
  }
  std::string device = spec->device.empty() ? "auto" : spec->device;
  if (!device_fits(device, pool_.backend)) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "device: job wants '" + spec->device + "' but this coordinator's pool is " +
                          backend_name(pool_.backend));
  }
  uint64_t token = next_check_token_++;
  pending_submits_[token] = PendingSubmit{rid, req, spec, now.steady + opts_.file_check_timeout};
  out.file_checks.push_back(FileCheck{token, spec, pool_.size});
}

void CoordinatorCore::file_check_done(uint64_t token, const std::vector<std::string>& problems,
                                      Now now, Effects& out) {
  auto it = pending_submits_.find(token);
  if (it == pending_submits_.end()) return;  // timed out: the client was answered
  PendingSubmit p = std::move(it->second);
  pending_submits_.erase(it);
  if (!problems.empty()) {
    return send_error(out, p.routing_id, p.request_id, ErrorCode::InvalidArgument,
                      JobSpecError(problems).what());
  }
  if (!store_error_.empty()) {
    return send_error(out, p.routing_id, p.request_id, ErrorCode::Internal,
                      "not accepting jobs: the job store cannot commit (" + store_error_ + ")");
  }
  // Checkpoints are on unless the job file turns them off, in a folder of
  // the job's own under the state directory unless it names one.
  if (!p.spec->checkpoint) p.spec->checkpoint = std::make_unique<proto::CheckpointSpecT>();
  auto& ckpt = *p.spec->checkpoint;
  if (ckpt.enabled && ckpt.directory.empty() && !opts_.state_dir.empty()) {
    ckpt.directory = opts_.state_dir + "/checkpoints/" + std::to_string(jobs_.next_id());
  }
  JobRecord& job = jobs_.add(p.spec, now.unix_ms);
  job.checkpoint = checkpoint_file(*p.spec);
  spdlog::info("{} queued (priority {}, checkpoint {})", job_label(job), job.priority,
               job.checkpoint.empty() ? "off" : job.checkpoint);
  proto::JobAcceptedT accepted;
  accepted.job_id = job.id;
  // Released once the job's row is committed (see Effects).
  send(out, p.routing_id, p.request_id, std::move(accepted));
  changed(job, out);
  schedule(now, out);
}

void CoordinatorCore::expire_file_checks(Now now, Effects& out) {
  for (auto it = pending_submits_.begin(); it != pending_submits_.end();) {
    if (it->second.deadline <= now.steady) {
      send_error(out, it->second.routing_id, it->second.request_id, ErrorCode::Timeout,
                 "checking the job's dataset files took longer than " +
                     std::to_string(opts_.file_check_timeout.count()) +
                     " ms (is one on a hung file system?); the job was not queued");
      it = pending_submits_.erase(it);
    } else {
      ++it;
    }
  }
}

// ---- Queries and cancel ----

void CoordinatorCore::on_list_jobs(const std::string& rid, const proto::Envelope& env,
                                   Effects& out) {
  const auto* l = env.body_as_ListJobs();
  uint32_t limit = l->limit() == 0 ? opts_.list_page_size : std::min(l->limit(), opts_.list_page_size);
  proto::JobListT list;
  auto it = jobs_.all().upper_bound(l->after_id());
  for (; it != jobs_.all().end() && list.jobs.size() < limit; ++it) {
    list.jobs.push_back(job_info(it->second, kSummaryDetail));
  }
  list.more = it != jobs_.all().end();
  send(out, rid, env.header()->request_id(), std::move(list));
}

void CoordinatorCore::on_get_job(const std::string& rid, const proto::Envelope& env,
                                 Effects& out) {
  uint64_t req = env.header()->request_id();
  uint64_t id = env.body_as_GetJob()->job_id();
  const JobRecord* job = jobs_.find(id);
  if (!job) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "no job with id " + std::to_string(id) +
                          (id < jobs_.next_id() ? " (finished jobs are pruned by retention)" : ""));
  }
  send(out, rid, req, std::move(*job_info(*job, kFullDetail)));
}

void CoordinatorCore::on_cancel(const std::string& rid, const proto::Envelope& env, Now now,
                                Effects& out) {
  uint64_t req = env.header()->request_id();
  uint64_t id = env.body_as_CancelJob()->job_id();
  JobRecord* job = jobs_.find(id);
  if (!job) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "no job with id " + std::to_string(id));
  }
  if (is_terminal(job->state)) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "job " + std::to_string(id) + " already " + job_state_name(job->state));
  }
  if (job->state == JobState::Queued) {
    finish(*job, JobState::Cancelled, "cancelled while queued", now, out);
  } else if (!job->cancel_requested) {
    // The agent stops between steps, releases its leases and reports; until
    // its heartbeat shows it stopping, StopJob is sent again.
    job->cancel_requested = true;
    auto agent = agents_.find(job->agent);
    if (!job->orphaned_since && agent != agents_.end() && agent->second.job_id == id) {
      push_stop(id, job->attempt_number(), agent->second, out);
      job->stop_sent = now.steady;
    }
    changed(*job, out);
  }
  spdlog::info("{}: cancel requested ({})", job_label(*job), job_state_name(job->state));
  send_ack(out, rid, req);  // after the cancel is stored
}

// ---- What agents report ----

void CoordinatorCore::on_job_update(const std::string& rid, AgentRecord& agent,
                                    const proto::Envelope& env, Now now, Effects& out) {
  uint64_t req = env.header()->request_id();
  const auto* u = env.body_as_JobUpdate();
  std::string state_text(u->state() ? str(u->state()) : "running");
  std::string reason(str(u->reason()));
  bool interrupted = state_text == "interrupted";
  auto state = parse_job_state(state_text);
  if (!interrupted && (!state || *state == JobState::Queued)) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "job update state '" + state_text +
                          "' is not running, succeeded, failed, cancelled or interrupted");
  }
  bool final_report = interrupted || is_terminal(*state);
  JobRecord* job = jobs_.find(u->job_id());
  bool ours = job && job->agent == agent.name && job->attempt_number() == u->attempt();
  std::string what = "job " + std::to_string(u->job_id()) + " attempt " +
                     std::to_string(u->attempt());
  if (!ours) {
    return send_error(out, rid, req, ErrorCode::NotOwner,
                      what + " is not running on agent '" + agent.name + "'");
  }
  if (final_report) {
    for (auto& r : agent.reported) {
      if (r.job_id == job->id) r.phase = proto::JobPhase::Reporting;  // it has stopped
    }
  }
  if (is_terminal(job->state) || job->state == JobState::Queued) {
    if (final_report && job->attempts.back().ended_ms != 0) {
      // The same final report again (our acknowledgement was lost or is
      // still waiting for its commit): acknowledge it once that is stored.
      out.store_puts.insert(job->id);
      return send_ack(out, rid, req);
    }
    return send_error(out, rid, req, ErrorCode::NotOwner,
                      what + " has ended (" + job_state_name(job->state) + ")");
  }

  // Running, on this agent, this attempt.
  job->assign_acked = true;
  if (job->orphaned_since) {
    job->orphaned_since.reset();
    agent.job_id = job->id;
  }
  bool stored = false;
  AttemptRecord& attempt = job->attempts.back();
  if (u->resumed_from_epoch() > 0 && attempt.resumed_from_epoch != u->resumed_from_epoch()) {
    attempt.resumed_from_epoch = u->resumed_from_epoch();
    // This attempt runs the epochs after its checkpoint again.
    std::erase_if(job->epochs,
                  [&](const proto::EpochStatT& e) { return e.epoch > attempt.resumed_from_epoch; });
    stored = true;
  }
  if (u->progress()) u->progress()->UnPackTo(&job->progress);
  if (u->epoch()) {
    proto::EpochStatT e;
    u->epoch()->UnPackTo(&e);
    auto pos = std::find_if(job->epochs.begin(), job->epochs.end(),
                            [&](const proto::EpochStatT& x) { return x.epoch >= e.epoch; });
    if (pos != job->epochs.end() && pos->epoch == e.epoch) {
      *pos = e;  // sent again, or run again after a resume
    } else {
      job->epochs.insert(pos, e);
    }
    stored = true;
  }
  if (interrupted) {
    requeue(*job, reason.empty() ? "interrupted on agent '" + agent.name + "'" : reason, false,
            now, out);
  } else if (*state == JobState::Running) {
    if (stored) {
      changed(*job, out);
    } else {
      out.events.push_back(job->id);  // progress is published, not stored
    }
  } else {
    job->test_accuracy = u->test_accuracy();
    job->samples_per_second = u->samples_per_second();
    // Cancelled without being asked means the agent gave up on it (for
    // example it is stopping): that is an interruption, not the user's cancel.
    if (*state == JobState::Cancelled && !job->cancel_requested) {
      requeue(*job, reason.empty() ? "stopped by agent '" + agent.name + "'" : reason, false, now,
              out);
    } else {
      finish(*job, *state, reason, now, out);
    }
  }
  send_ack(out, rid, req);
  if (final_report) schedule(now, out);
}

void CoordinatorCore::reconcile(AgentRecord& agent, const proto::Register* reg,
                                const proto::Heartbeat* hb, Now now, Effects& out) {
  const auto* list = reg ? reg->jobs() : hb ? hb->jobs() : nullptr;
  agent.reported.clear();
  if (list) {
    for (const auto* r : *list) {
      proto::AgentJobT t;
      r->UnPackTo(&t);
      agent.reported.push_back(t);
    }
  }
  for (const auto& r : agent.reported) {
    JobRecord* job = jobs_.find(r.job_id);
    bool ours = job && job->state == JobState::Running && job->agent == agent.name &&
                job->attempt_number() == r.attempt;
    if (ours) {
      if (job->orphaned_since) {
        // Back after a restart and still holding it: the old session's
        // leases are void, so it must stop; it then reports the job
        // interrupted (or its result, if it had finished).
        job->orphaned_since.reset();
        agent.job_id = job->id;
        spdlog::info("{}: agent '{}' is back and still has it; waiting for it to stop",
                     job_label(*job), agent.name);
        if (active(r.phase)) {
          job->stop_wanted = true;
          push_stop(job->id, r.attempt, agent, out);
          job->stop_sent = now.steady;
        }
      }
      job->assign_acked = true;
      continue;
    }
    if (active(r.phase) && now.steady - agent.stray_stop_sent >= opts_.heartbeat_interval) {
      spdlog::warn("agent '{}' runs job {} attempt {}, which is not its job here; telling it to stop",
                   agent.name, r.job_id, r.attempt);
      push_stop(r.job_id, r.attempt, agent, out);
      agent.stray_stop_sent = now.steady;
    }
  }
  if (!reg) return;
  // Jobs that waited since a restart for this agent, which no longer has them.
  for (auto& [id, job] : jobs_.all()) {
    if (job.orphaned_since && job.agent == agent.name) {
      requeue(job, "coordinator restarted; agent '" + agent.name + "' no longer runs it", false,
              now, out);
    }
  }
}

// ---- Scheduling and the agents' acknowledgements ----

void CoordinatorCore::schedule(Now now, Effects& out) {
  // A job some agent still runs or stops is not started anywhere else.
  std::set<uint64_t> held;
  for (const auto& [name, agent] : agents_) {
    for (const auto& r : agent.reported) {
      if (r.phase != proto::JobPhase::Reporting) held.insert(r.job_id);
    }
  }
  std::vector<JobRecord*> candidates;
  for (JobRecord* job : jobs_.queued()) {
    if (!held.count(job->id) && device_fits(job->device, pool_.backend)) {
      candidates.push_back(job);
    }
  }
  for (auto& [name, agent] : agents_) {
    if (candidates.empty()) return;
    if (!agent.idle()) continue;
    JobRecord* job = policy_->pick_job(agent, candidates);
    if (!job) continue;
    assign(*job, agent, now, out);
    std::erase(candidates, job);
  }
}

void CoordinatorCore::assign(JobRecord& job, AgentRecord& agent, Now now, Effects& out) {
  AttemptRecord attempt;
  attempt.number = job.attempt_number() + 1;
  attempt.agent = agent.name;
  attempt.started_ms = now.unix_ms;
  job.attempts.push_back(attempt);
  job.agent = agent.name;
  job.assign_acked = false;
  job.stop_wanted = false;
  job.assign_sent = now.steady;
  agent.job_id = job.id;
  jobs_.set_state(job, JobState::Running, now.unix_ms,
                  "attempt " + std::to_string(attempt.number) + " on agent '" + agent.name + "'");
  // The push leaves once the assignment is stored: after a crash the job is
  // known to be on this agent, never on one that does not know it.
  push_assign(job, agent, out);
  spdlog::info("{} assigned to agent '{}' (attempt {})", job_label(job), agent.name,
               attempt.number);
  changed(job, out);
}

void CoordinatorCore::push_assign(const JobRecord& job, const AgentRecord& agent, Effects& out) {
  proto::AssignJobT a;
  a.job_id = job.id;
  a.attempt = job.attempt_number();
  a.spec = std::make_unique<proto::JobSpecT>(*job.spec);
  // Every socket of the agent gets it; the agent's heartbeat thread acts on
  // it and ignores duplicates.
  for (const auto& rid : agent.routing_ids) send(out, rid, 0, proto::AssignJobT(a));
}

void CoordinatorCore::push_stop(uint64_t job_id, uint32_t attempt, const AgentRecord& agent,
                                Effects& out) {
  proto::StopJobT s;
  s.job_id = job_id;
  s.attempt = attempt;
  for (const auto& rid : agent.routing_ids) send(out, rid, 0, proto::StopJobT(s));
}

void CoordinatorCore::resend_pushes(Now now, Effects& out) {
  for (auto& [name, agent] : agents_) {
    if (!agent.job_id) continue;
    JobRecord* job = jobs_.find(agent.job_id);
    if (!job || job->state != JobState::Running || job->agent != name) {
      agent.job_id = 0;  // defensive: nothing of ours runs there
      continue;
    }
    bool stop = job->cancel_requested || job->stop_wanted;
    if (!stop && !job->assign_acked && now.steady - job->assign_sent >= opts_.heartbeat_interval) {
      spdlog::debug("{}: assignment to '{}' not acknowledged yet; sending it again",
                    job_label(*job), name);
      push_assign(*job, agent, out);
      job->assign_sent = now.steady;
    }
    if (stop && now.steady - job->stop_sent >= opts_.heartbeat_interval) {
      // Until the agent shows it stopping (or has never shown it at all).
      auto r = std::find_if(agent.reported.begin(), agent.reported.end(),
                            [&](const proto::AgentJobT& x) { return x.job_id == job->id; });
      if (r == agent.reported.end() || active(r->phase)) {
        push_stop(job->id, job->attempt_number(), agent, out);
        job->stop_sent = now.steady;
      }
    }
  }
}

// ---- Ends and requeues ----

void CoordinatorCore::finish(JobRecord& job, JobState state, const std::string& reason, Now now,
                             Effects& out) {
  if (auto* a = job.current_attempt(); a && a->ended_ms == 0) {
    a->ended_ms = now.unix_ms;
    a->outcome = job_state_name(state);
    a->reason = reason;
  }
  if (auto it = agents_.find(job.agent); it != agents_.end() && it->second.job_id == job.id) {
    it->second.job_id = 0;
  }
  job.orphaned_since.reset();
  jobs_.set_state(job, state, now.unix_ms, reason);
  if (state == JobState::Succeeded) job.reason.clear();
  spdlog::info("{} {}{}{}", job_label(job), job_state_name(state), reason.empty() ? "" : ": ",
               reason);
  changed(job, out);
}

void CoordinatorCore::requeue(JobRecord& job, const std::string& why, bool agent_lost, Now now,
                              Effects& out) {
  if (auto* a = job.current_attempt(); a && a->ended_ms == 0) {
    a->ended_ms = now.unix_ms;
    a->outcome = agent_lost ? "agent lost" : "interrupted";
    a->reason = why;
  }
  if (auto it = agents_.find(job.agent); it != agents_.end() && it->second.job_id == job.id) {
    it->second.job_id = 0;
  }
  job.orphaned_since.reset();
  job.assign_acked = false;
  job.stop_wanted = false;
  if (job.cancel_requested) return finish(job, JobState::Cancelled, "cancelled: " + why, now, out);
  if (agent_lost && ++job.agent_failures > static_cast<uint32_t>(job.max_attempts)) {
    std::string reasons;
    for (const auto& a : job.attempts) {
      reasons += (reasons.empty() ? "" : "; ") + std::string("attempt ") +
                 std::to_string(a.number) + ": " + a.reason;
    }
    return finish(job, JobState::Failed,
                  "gave up after " + std::to_string(job.attempts.size()) + " attempts (" +
                      std::to_string(job.agent_failures) + " lost their agent; max_attempts " +
                      std::to_string(job.max_attempts) + "): " + reasons,
                  now, out);
  }
  int32_t from = job.last_checkpoint_epoch();
  std::string next = job.checkpoint.empty()
                         ? "restarting from the beginning (checkpoints are off)"
                     : from > 0 ? "resuming from epoch " + std::to_string(from)
                                : "restarting from the beginning (no checkpoint yet)";
  jobs_.set_state(job, JobState::Queued, now.unix_ms, why + "; " + next);
  spdlog::warn("{} requeued: {}; {}", job_label(job), why, next);
  changed(job, out);
}

void CoordinatorCore::release_orphans(Now now, Effects& out) {
  for (auto& [id, job] : jobs_.all()) {
    if (job.orphaned_since && now.steady - *job.orphaned_since >= opts_.recovery_grace) {
      requeue(job,
              "coordinator restarted; agent '" + job.agent + "' did not come back within " +
                  std::to_string(opts_.recovery_grace.count()) + " ms",
              false, now, out);
    }
  }
}

void CoordinatorCore::recover(std::vector<JobRecord> jobs, uint64_t next_id, Now now,
                              Effects& out) {
  size_t queued = 0, orphaned = 0;
  for (auto& job : jobs) {
    if (job.state == JobState::Running) {
      job.orphaned_since = now.steady;
      ++orphaned;
    }
    queued += job.state == JobState::Queued;
    if (!is_terminal(job.state) && !device_fits(job.device, pool_.backend)) {
      spdlog::warn("{} wants device '{}' but this coordinator's pool is {}; it stays queued",
                   job_label(job), job.device, backend_name(pool_.backend));
    }
    jobs_.restore(std::move(job));
  }
  jobs_.raise_next_id(next_id);
  spdlog::info("job store: {} jobs ({} queued, {} were running and wait for their agent); next "
               "id {}",
               jobs_.all().size(), queued, orphaned, jobs_.next_id());
  prune(now, out);
}

void CoordinatorCore::prune(Now now, Effects& out) {
  if (last_prune_ && now.steady - *last_prune_ < std::chrono::minutes(1)) return;
  last_prune_ = now.steady;
  std::vector<const JobRecord*> finished;
  for (const auto& [id, job] : jobs_.all()) {
    if (is_terminal(job.state)) finished.push_back(&job);
  }
  std::sort(finished.begin(), finished.end(), [](const JobRecord* a, const JobRecord* b) {
    return a->finished_ms != b->finished_ms ? a->finished_ms > b->finished_ms : a->id > b->id;
  });
  const uint64_t age_ms = static_cast<uint64_t>(opts_.retention_age.count());
  std::vector<uint64_t> doomed;
  for (size_t i = 0; i < finished.size(); ++i) {
    const JobRecord& job = *finished[i];
    bool too_old = now.unix_ms > job.finished_ms && now.unix_ms - job.finished_ms > age_ms;
    if (i >= opts_.retention_count || too_old) doomed.push_back(job.id);
  }
  for (uint64_t id : doomed) {
    const JobRecord& job = *jobs_.find(id);
    // Only the folders the coordinator made; a directory the job file named
    // belongs to the user.
    std::string own = opts_.state_dir + "/checkpoints/" + std::to_string(id);
    if (!opts_.state_dir.empty() && job.spec && job.spec->checkpoint &&
        job.spec->checkpoint->directory == own) {
      out.remove_dirs.push_back(own);
    }
    out.store_deletes.push_back(id);
    jobs_.erase(id);
  }
  if (!doomed.empty()) {
    spdlog::info("retention: pruned {} finished jobs (keeping at most {}, none older than {} h)",
                 doomed.size(), opts_.retention_count, age_ms / 3600000);
  }
}

}  // namespace leasehold
