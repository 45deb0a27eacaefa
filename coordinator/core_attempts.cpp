// How the core's jobs meet agents: what agents list in Register and
// Heartbeat, assignment (placement is in core_placement.cpp) and stop pushed again
// until acknowledged, the end of an attempt (finished, or requeued after a
// lost agent or a restart), recovery at start, and retention.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/core.h"
#include "coordinator/replies.h"
#include "shared/printable.h"
#include "shared/protocol.h"

namespace leasehold {
namespace {

bool active(proto::JobPhase p) {
  return p == proto::JobPhase::Queued || p == proto::JobPhase::Running;
}

}  // namespace

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
  bool lists_its_job = false;
  for (const auto& r : agent.reported) {
    JobRecord* job = jobs_.find(r.job_id);
    const int rank = job ? job->rank_on(agent.name) : -1;
    bool ours = job && job->state == JobState::Running && rank >= 0 &&
                job->attempt_number() == r.attempt && runs_as(*job, agent);
    if (ours && rank > 0) {
      // A replica of a data-parallel job (which never waits as an orphan:
      // its gang stops when one of them is lost).
      if (static_cast<size_t>(rank) <= job->replicas_acked.size()) {
        job->replicas_acked[rank - 1] = true;
      }
      lists_its_job |= job->id == agent.job_id;
      continue;
    }
    if (ours) {
      if (job->orphaned_since) {
        // Back and still holding it: the old session's leases are void, so
        // it must stop; it then reports the job interrupted (or its result,
        // if it had finished).
        job->orphaned_since.reset();
        agent.job_id = job->id;
        spdlog::info("{}: agent '{}' is back and still has it; waiting for it to stop",
                     job_label(*job), agent.name);
        if (active(r.phase)) {
          job->stop_wanted = true;
          push_stop(job->id, r.attempt, false, "its coordinator session was lost", agent, out,
                    false);
          job->stop_sent = now.steady;
        }
      }
      job->assign_acked = true;
      lists_its_job |= job->id == agent.job_id;
      continue;
    }
    auto& last = agent.stray_stops[r.job_id];
    if (active(r.phase) && now.steady - last >= opts_.heartbeat_interval) {
      spdlog::warn(
          "agent '{}' runs job {} attempt {}, which is not its job here; telling it to stop",
          agent.name, r.job_id, r.attempt);
      push_stop(r.job_id, r.attempt, false,
                "job " + std::to_string(r.job_id) + " attempt " + std::to_string(r.attempt) +
                    " is not this agent's to run any more",
                agent, out, false);
      last = now.steady;
    }
  }
  std::erase_if(agent.stray_stops, [&](const auto& kv) {
    return std::none_of(agent.reported.begin(), agent.reported.end(),
                        [&](const proto::AgentJobT& r) { return r.job_id == kv.first; });
  });
  // An agent that stopped listing the job it had acknowledged no longer has
  // it (its final report was lost): back to the queue.
  if (hb && agent.job_id && !lists_its_job) {
    JobRecord* job = jobs_.find(agent.job_id);
    const int rank = job ? job->rank_on(agent.name) : -1;
    const bool replica_done = rank > 0 &&
                              static_cast<size_t>(rank) <= job->replicas_succeeded.size() &&
                              job->replicas_succeeded[rank - 1];
    const bool acked = rank > 0 ? static_cast<size_t>(rank) <= job->replicas_acked.size() &&
                                      job->replicas_acked[rank - 1]
                                : job && job->assign_acked;
    if (job && acked && !replica_done) {
      requeue(*job, Interruption::SessionLost,
              "agent '" + agent.name + "' no longer has it (its report was lost)", false, now, out);
    }
  }
  // Fenced leases of this agent go back once it runs nothing any more and
  // holds nothing of its old session.
  if (!agent.reports_busy() && agent.stale_holds == 0) {
    release_fence(agent.name, "the agent stopped its work and holds none of them", out);
  }
  if (!reg) return;
  // Jobs that waited for this agent (a restart, a lost session), which it
  // no longer has.
  // (Orphans are running jobs; the ids are copied: requeue changes the index.)
  const std::vector<uint64_t> running(jobs_.running().begin(), jobs_.running().end());
  for (uint64_t id : running) {
    JobRecord& job = *jobs_.find(id);
    if (job.orphaned_since && job.agent == agent.name) {
      requeue(job, job.orphan_kind,
              "agent '" + agent.name + "' came back without it (" +
                  std::string(job.orphan_kind == Interruption::CoordinatorRestart
                                  ? "the coordinator restarted"
                                  : "its session was lost") +
                  ")",
              false, now, out);
    }
  }
}

// ---- Assignment and the agents' acknowledgements ----

void CoordinatorCore::assign(JobRecord& job, const std::vector<AgentRecord*>& agents, Now now,
                             Effects& out) {
  AgentRecord& agent = *agents.front();  // rank 0
  end_memory_wait(job, now);
  AttemptRecord attempt;
  attempt.number = job.attempt_number() + 1;
  attempt.agent = agent.name;
  attempt.agent_identity = agent.identity;
  attempt.started_ms = now.unix_ms;
  for (size_t rank = 1; rank < agents.size(); ++rank) {
    attempt.replica_agents.push_back(agents[rank]->name);
  }
  job.attempts.push_back(attempt);
  // The latest attempts are kept, as many as state changes (each number
  // says how many came before).
  if (job.attempts.size() > opts_.history_kept) {
    job.attempts.erase(job.attempts.begin(),
                       job.attempts.end() - static_cast<std::ptrdiff_t>(opts_.history_kept));
  }
  job.agent = agent.name;
  job.assign_acked = false;
  job.replicas_acked.assign(agents.size() - 1, false);
  job.replicas_succeeded.assign(agents.size() - 1, false);
  job.master_port = 0;
  if (agents.size() > 1) {
    job.master_port = opts_.free_port ? opts_.free_port() : 0;
    if (job.master_port == 0) job.master_port = static_cast<uint16_t>(29500 + job.id % 1000);
  }
  job.stop_wanted = false;
  job.assign_sent = now.steady;
  job.assigned_steady = now.steady;
  job.assigned_at_us = now.unix_us ? now.unix_us : now.unix_ms * 1000;
  job.first_step_at_us = 0;
  job.probation_since.reset();  // from this attempt's first step
  // A program's session proves its attempt with this, and a gang's
  // replicas their rendezvous (AssignJob only).
  job.program_token =
      job.is_program() || agents.size() > 1 ? SessionToken::random() : SessionToken{};
  job.attempt_log_bytes = 0;
  std::string where = "agent '" + agent.name + "'";
  for (size_t rank = 1; rank < agents.size(); ++rank) {
    where += (rank + 1 == agents.size() ? " and '" : ", '") + agents[rank]->name + "'";
  }
  if (agents.size() > 1) where = std::to_string(agents.size()) + " replicas on agents " + where.substr(6);
  if (job.is_program() && job.attempts.size() > 1) {
    append_log(job, "[leasehold: attempt " + std::to_string(attempt.number) + " on " + where + "]\n",
               0);
    job.attempt_log_bytes = 0;
  }
  for (AgentRecord* a : agents) a->job_id = job.id;
  jobs_.set_state(job, JobState::Running, now.unix_ms,
                  "attempt " + std::to_string(attempt.number) + " on " + where);
  // The pushes leave once the assignment is stored: after a crash the job
  // is known to be on these agents, never on one that does not know it.
  for (AgentRecord* a : agents) push_assign(job, *a, out);
  spdlog::info("{} assigned to {} (attempt {})", job_label(job), where, attempt.number);
  changed(job, out);
}

void CoordinatorCore::push_assign(const JobRecord& job, const AgentRecord& agent, Effects& out) {
  proto::AssignJobT a;
  a.job_id = job.id;
  a.attempt = job.attempt_number();
  a.spec = std::make_unique<proto::JobSpecT>(*job.spec);
  a.private_checkpoint =
      job.spec->checkpoint && job.spec->checkpoint->directory == private_checkpoint_dir(job.id);
  a.submitter_uid = job.submitted_uid ? static_cast<int64_t>(*job.submitted_uid) : -1;
  a.job_token_lo = job.program_token.lo;
  a.job_token_hi = job.program_token.hi;
  a.rank = std::max(0, job.rank_on(agent.name));
  a.world_size = job.replicas();
  if (a.world_size > 1) {
    // Agents share the coordinator's host: its devices are theirs.
    a.master_addr = "127.0.0.1";
    a.master_port = job.master_port;
  }
  // Every socket of the agent gets it; the agent's heartbeat thread acts on
  // it and ignores duplicates. It leaves once the assignment is stored, so
  // after a crash the job is never on an agent the store does not name.
  out.store_puts.insert(job.id);
  for (const auto& rid : agent.routing_ids) send(out, rid, 0, proto::AssignJobT(a), true, job.id);
}

void CoordinatorCore::stop_replicas(const JobRecord& job, const std::string& reason,
                                    Effects& out) {
  if (job.replicas() == 1) return;
  for (const std::string& name : job.gang()) {
    auto it = agents_.find(name);
    if (it == agents_.end() || it->second.job_id != job.id) continue;
    push_stop(job.id, job.attempt_number(), false, "its data-parallel gang stopped: " + reason,
              it->second, out, false);
  }
}

void CoordinatorCore::push_stop(uint64_t job_id, uint32_t attempt, bool cancel,
                                const std::string& reason, const AgentRecord& agent, Effects& out,
                                bool after_store) {
  proto::StopJobT s;
  s.job_id = job_id;
  s.attempt = attempt;
  s.cancel = cancel;
  s.reason = reason;
  if (after_store) out.store_puts.insert(job_id);
  for (const auto& rid : agent.routing_ids) send(out, rid, 0, proto::StopJobT(s), after_store);
}

void CoordinatorCore::resend_pushes(Now now, Effects& out) {
  // A job's resend clocks are restarted once every agent of it had its turn
  // (a data-parallel job's replicas each get the push again).
  std::set<JobRecord*> assign_resent, stop_resent;
  for (auto& [name, agent] : agents_) {
    if (!agent.job_id) continue;
    JobRecord* job = jobs_.find(agent.job_id);
    const int rank = job ? job->rank_on(name) : -1;
    if (!job || job->state != JobState::Running || rank < 0) {
      agent.job_id = 0;  // defensive: nothing of ours runs there
      continue;
    }
    const bool acked = rank == 0 ? job->assign_acked
                       : static_cast<size_t>(rank) <= job->replicas_acked.size()
                           ? static_cast<bool>(job->replicas_acked[rank - 1])
                           : true;
    const auto ack_within = std::max(opts_.assign_timeout, 3 * opts_.heartbeat_interval);
    if (!acked && job->assigned_steady &&
        now.steady - *job->assigned_steady >= ack_within) {
      // Never acknowledged: the agent does not run it (a fake agent, or one
      // stuck). The job goes back uncharged (a cancelled one ends), and
      // this agent gets no more jobs until it registers again.
      const std::string why = "agent '" + name + "' did not acknowledge the assignment within " +
                              std::to_string(ack_within.count()) + " ms";
      spdlog::warn("{}: {}; it gets no more jobs in this session", job_label(*job), why);
      agent.ignored_assignment = true;
      push_stop(job->id, job->attempt_number(), false, why, agent, out, false);
      requeue(*job, Interruption::Unacknowledged, why, false, now, out);
      continue;
    }
    // A live agent holds it: the clock starts now if the cancel came while
    // it was away (orphaned, or recovered from the store).
    if (job->cancel_requested && !job->cancel_since) job->cancel_since = now.steady;
    if (job->cancel_requested && now.steady - *job->cancel_since >= opts_.stop_timeout) {
      // Cancelled, and the agent still has not ended it (a fake agent that
      // acknowledges and ignores StopJob, one stuck): the job ends anyway,
      // and the agent gets no more jobs until it registers again.
      const std::string why = "agent '" + name + "' did not stop it within " +
                              std::to_string(opts_.stop_timeout.count()) + " ms (stop_timeout)";
      spdlog::warn("{}: {}; it gets no more jobs in this session", job_label(*job), why);
      agent.ignored_assignment = true;
      finish(*job, JobState::Cancelled, "cancelled; " + why, now, out);
      continue;
    }
    bool stop = job->cancel_requested || job->stop_wanted;
    if (!stop && !acked &&
        (assign_resent.count(job) || now.steady - job->assign_sent >= opts_.heartbeat_interval)) {
      spdlog::debug("{}: assignment to '{}' not acknowledged yet; sending it again",
                    job_label(*job), name);
      push_assign(*job, agent, out);
      assign_resent.insert(job);
    }
    if (stop &&
        (stop_resent.count(job) || now.steady - job->stop_sent >= opts_.heartbeat_interval)) {
      // Until the agent shows it stopping (or has never shown it at all).
      auto r = std::find_if(agent.reported.begin(), agent.reported.end(),
                            [&](const proto::AgentJobT& x) { return x.job_id == job->id; });
      if (r == agent.reported.end() || active(r->phase)) {
        if (job->cancel_requested) {
          push_stop(job->id, job->attempt_number(), true, "cancelled by request", agent, out, true);
        } else {
          push_stop(job->id, job->attempt_number(), false, "its coordinator session was lost",
                    agent, out, false);
        }
        stop_resent.insert(job);
      }
    }
  }
  for (JobRecord* job : assign_resent) job->assign_sent = now.steady;
  for (JobRecord* job : stop_resent) job->stop_sent = now.steady;
}

// ---- Ends and requeues ----

void CoordinatorCore::end_attempt(JobRecord& job, const std::string& outcome,
                                  const std::string& reason, Now now) {
  if (auto* a = job.current_attempt(); a && a->ended_ms == 0) {
    a->ended_ms = now.unix_ms;
    a->outcome = outcome;
    a->reason = printable(reason, kReasonBytes);
  }
  for (const std::string& name : job.gang()) {
    if (auto it = agents_.find(name); it != agents_.end() && it->second.job_id == job.id) {
      it->second.job_id = 0;
      // Its memory goes with the job; a late answer is acknowledged and ignored.
      it->second.shrink.reset();
    }
  }
  job.orphaned_since.reset();
  job.orphan_counts = false;
  job.orphan_process.reset();
  job.orphan_cause.clear();
  job.assign_acked = false;
  job.stop_wanted = false;
  job.assigned_steady.reset();
}

void CoordinatorCore::finish(JobRecord& job, JobState state, const std::string& reason, Now now,
                             Effects& out) {
  // Replicas still at work when the job fails (one of them failed) stop;
  // after a success they are ending by themselves.
  if (state != JobState::Succeeded) stop_replicas(job, reason, out);
  end_attempt(job, job_state_name(state), reason, now);
  end_program_session(job, "ended with its job", now, out);
  jobs_.set_state(job, state, now.unix_ms, reason);
  if (state == JobState::Succeeded) job.reason.clear();
  spdlog::info("{} {}{}{}", job_label(job), job_state_name(state), reason.empty() ? "" : ": ",
               reason);
  changed(job, out);
}

void CoordinatorCore::requeue(JobRecord& job, Interruption cause, const std::string& reported,
                              bool counts, Now now, Effects& out, const std::string& outcome) {
  const std::string why =
      job.orphan_cause.empty() ? reported : job.orphan_cause + "; then: " + reported;
  if (auto* a = job.current_attempt(); a && a->ended_ms == 0) {
    a->cause = std::string(interruption_name(cause));
  }
  ++job.interruptions[std::string(interruption_name(cause))];
  ++interruptions_[cause];
  stop_replicas(job, why, out);
  end_attempt(job, counts ? outcome : "interrupted", why, now);
  end_program_session(job, "outlived its job's attempt", now, out);
  if (job.cancel_requested) return finish(job, JobState::Cancelled, "cancelled: " + why, now, out);
  if (counts && ++job.agent_failures > static_cast<uint32_t>(job.max_attempts)) {
    std::string reasons;
    for (const auto& a : job.attempts) {
      reasons += (reasons.empty() ? "" : "; ") + std::string("attempt ") +
                 std::to_string(a.number) + ": " + a.reason;
    }
    return finish(job, JobState::Failed,
                  "gave up after " + std::to_string(job.attempt_number()) + " attempts (" +
                      std::to_string(job.agent_failures) +
                      " lost their agent or faulted on the device; max_attempts " +
                      std::to_string(job.max_attempts) + "): " + reasons,
                  now, out);
  }
  int32_t from = job.last_checkpoint_epoch();
  std::string next = job.checkpoint.empty() ? "restarting from the beginning (checkpoints are off)"
                     : from > 0             ? "resuming from epoch " + std::to_string(from)
                                            : "restarting from the beginning (no checkpoint yet)";
  jobs_.set_state(job, JobState::Queued, now.unix_ms, why + "; " + next);
  spdlog::warn("{} requeued: {}; {}", job_label(job), why, next);
  changed(job, out);
}

void CoordinatorCore::release_orphans(Now now, Effects& out) {
  const std::string grace = std::to_string(opts_.recovery_grace.count()) + " ms";
  // Ended by check_fences (which runs first) after the grace.
  auto killed = [&](const JobRecord& job) {
    auto f = fences_.find(job.agent);
    return f != fences_.end() && f->second.end == Fence::End::Killed;
  };
  // (Orphans are running jobs; the ids are copied: requeue changes the index.)
  const std::vector<uint64_t> running(jobs_.running().begin(), jobs_.running().end());
  for (uint64_t id : running) {
    JobRecord& job = *jobs_.find(id);
    if (!job.orphaned_since) continue;
    if (killed(job)) {
      requeue(job, Interruption::AgentSilent,
              "agent '" + job.agent + "' fell silent and was killed after " + grace +
                  " (end_silent_agents)",
              true, now, out);
    } else if (gone(job.orphan_process)) {
      // A silent agent whose process has ended since (a killed process can
      // take a while to exit, a GPU context with it) is simply dead.
      requeue(job, Interruption::AgentDied,
              "agent '" + job.agent + "' died (silent, then its process ended)", true, now, out);
    } else if (now.steady - *job.orphaned_since >= opts_.recovery_grace) {
      // Counted when its agent fell silent while alive; a restart of the
      // coordinator is not the job's agent failing. Its memory stays fenced
      // while that agent's process lives, but the job need not wait for it.
      bool counts = job.orphan_counts;
      requeue(job, job.orphan_kind,
              (counts ? "agent '" + job.agent + "' fell silent and"
                      : "coordinator restarted; agent '" + job.agent + "'") +
                  " did not come back within " + grace,
              counts, now, out);
    }
  }
}

void CoordinatorCore::recover(std::vector<JobRecord> jobs, uint64_t next_id, Now now,
                              Effects& out) {
  now_ = now;
  size_t queued = 0, orphaned = 0;
  std::vector<uint64_t> gangs;
  for (auto& job : jobs) {
    if (job.state == JobState::Running && job.replicas() > 1) {
      // Replicas cannot be taken back one by one: the gang starts again
      // from its checkpoint (below), and agents that still run a replica
      // are told to stop when they register.
      gangs.push_back(job.id);
    } else if (job.state == JobState::Running) {
      job.orphaned_since = now.steady;
      job.orphan_kind = Interruption::CoordinatorRestart;
      ++orphaned;
    }
    queued += job.state == JobState::Queued;
    if (!is_terminal(job.state) && !device_fits_any(job.device)) {
      spdlog::warn("{} wants device '{}', which this coordinator does not serve; it stays queued",
                   job_label(job), job.device);
    }
    note_shares(job, largest_pool());
    if (!job.submit_key.empty()) submit_keys_[job.submit_key] = job.id;
    jobs_.restore(std::move(job));
  }
  jobs_.raise_next_id(next_id);
  for (uint64_t id : gangs) {
    requeue(*jobs_.find(id), Interruption::CoordinatorRestart,
            "the coordinator restarted under its data-parallel replicas", false, now, out);
  }
  spdlog::info(
      "job store: {} jobs ({} queued, {} were running and wait for their agent); next "
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
    const std::string own = private_checkpoint_dir(id);
    if (!opts_.state_dir.empty() && job.spec && job.spec->checkpoint &&
        job.spec->checkpoint->directory == own) {
      out.remove_dirs.push_back(own);
    }
    out.store_deletes.push_back(id);
    if (!job.submit_key.empty()) submit_keys_.erase(job.submit_key);
    suspects_.erase(id);
    jobs_.erase(id);
  }
  if (!doomed.empty()) {
    spdlog::info("retention: pruned {} finished jobs (keeping at most {}, none older than {} h)",
                 doomed.size(), opts_.retention_count, age_ms / 3600000);
  }
}

}  // namespace leasehold
