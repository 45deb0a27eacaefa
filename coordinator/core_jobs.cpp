// The core's jobs, as clients and agents speak of them: submission (after
// the file checks), listing, cancellation, and what agents report. How jobs
// meet agents (assignment, reconciliation, requeues, restarts, retention)
// is in core_attempts.cpp.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/core.h"
#include "coordinator/job_codec.h"
#include "coordinator/replies.h"
#include "shared/job_spec.h"
#include "shared/printable.h"
#include "shared/protocol.h"

namespace leasehold {
namespace {
bool submitted_by(const JobRecord& job, const Peer& peer);
}  // namespace

bool CoordinatorCore::device_fits(const std::string& device, const DeviceState& dev) {
  const auto wants = parse_job_device(device);
  if (!wants) return false;
  if (wants->ordinal && *wants->ordinal != dev.ordinal()) return false;
  if (wants->backend == "cuda") return dev.pool.backend == Backend::Cuda;
  if (wants->backend == "cpu") return dev.pool.backend == Backend::Host;
  return true;
}

bool CoordinatorCore::device_fits_any(const std::string& device) const {
  for (const auto& [ordinal, dev] : devices_) {
    if (device_fits(device, dev)) return true;
  }
  return false;
}

std::string CoordinatorCore::job_label(const JobRecord& job) {
  return "job " + std::to_string(job.id) + " '" + job.name + "'";
}

void CoordinatorCore::changed(const JobRecord& job, Effects& out) {
  out.store_puts.insert(job.id);
  out.events.push_back(job.id);
}

namespace {
// Whether `peer` is who submitted `job`: the same uid on ipc://, the same
// CURVE key over the network (peers of neither kind are one anonymous user).
bool submitted_by(const JobRecord& job, const Peer& peer) {
  if (peer.known) return job.submitted_uid && *job.submitted_uid == peer.uid;
  return !job.submitted_uid && job.submitted_by == peer.key_user();
}
}  // namespace

std::optional<std::string> CoordinatorCore::owner_refusal(const JobRecord& job, const Peer& peer,
                                                          const std::string& what) const {
  // Its submitter, or an administrator (coordinator/access.h).
  if ((peer.known || !peer.key.empty()) && submitted_by(job, peer)) return std::nullopt;
  auto refusal = opts_.access.check(Role::Admin, peer);
  if (!refusal) return std::nullopt;
  spdlog::warn("refused to {} job {} for {}: {}", what, job.id,
               peer.known          ? opts_.access.user_name(peer)
               : !peer.key.empty() ? peer.key_user()
                                   : "an unknown user",
               *refusal);
  return "job " + std::to_string(job.id) + " was submitted by " +
         (job.submitted_by.empty() ? "an unknown user" : job.submitted_by) + ": " + *refusal;
}

std::string CoordinatorCore::store_refusal() const {
  return "not accepting jobs: the job store cannot commit (" + store_error_ +
         "); nothing was queued: try again once it can";
}

bool CoordinatorCore::withdraw_submission(uint64_t job_id, Now now, Effects& out) {
  now_ = now;
  JobRecord* job = jobs_.find(job_id);
  if (!job) return false;
  // An agent it was assigned to never heard of it: the assignment waited
  // for the same commit.
  for (const std::string& name : job->gang()) {
    if (auto it = agents_.find(name); it != agents_.end() && it->second.job_id == job_id) {
      it->second.job_id = 0;
      it->second.shrink.reset();
    }
  }
  if (!job->submit_key.empty()) submit_keys_.erase(job->submit_key);
  suspects_.erase(job_id);
  spdlog::warn("{} withdrawn: the job store could not commit it ({}); its submitter is told so",
               job_label(*job), store_error_);
  jobs_.erase(job_id);
  out.store_deletes.push_back(job_id);
  schedule(now, out);
  return true;
}

// ---- Submission ----

void CoordinatorCore::on_submit(const std::string& rid, const proto::Envelope& env, Now now,
                                Effects& out, const Peer& peer) {
  uint64_t req = env.header()->request_id();
  if (auto refusal = opts_.access.check(Role::Client, peer)) {
    return send_error(out, rid, req, ErrorCode::PermissionDenied, *refusal);
  }
  // A program runs its own code as the agents' user.
  if (const auto* s = env.body_as_SubmitJob(); s->spec() && s->spec()->program()) {
    if (auto refusal = opts_.access.check(Role::Program, peer)) {
      return send_error(out, rid, req, ErrorCode::PermissionDenied, *refusal);
    }
  }
  const auto* submit = env.body_as_SubmitJob();
  const std::string key(str(submit->key()));
  if (key.size() > 64 ||
      key.find_first_not_of("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
                            "0123456789_-") != std::string::npos) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "SubmitJob.key must be 1-64 of A-Z, a-z, 0-9, '_' and '-'");
  }
  // Nothing is acknowledged that could not be stored; a retry comes back.
  if (!store_error_.empty()) {
    return send_error(out, rid, req, ErrorCode::Unavailable, store_refusal());
  }
  const std::string indexed = key.empty() ? "" : submit_key_of(peer.identity(), key);
  if (!indexed.empty()) {
    // A retry of a submission this coordinator has: the same answer.
    if (auto it = submit_keys_.find(indexed); it != submit_keys_.end()) {
      proto::JobAcceptedT accepted;
      accepted.job_id = it->second;
      // Once the job's row is committed (rewritten: this call's write).
      out.store_puts.insert(it->second);
      send(out, rid, req, std::move(accepted), true, it->second);
      return;
    }
    for (auto& [token, p] : pending_submits_) {
      if (p.key == indexed) {
        // Still being checked: its result answers this request instead.
        p.routing_id = rid;
        p.request_id = req;
        return;
      }
    }
  }
  // This user's, queued or being checked.
  size_t queued = jobs_.queued_by(peer.identity());
  for (const auto& [token, p] : pending_submits_) {
    queued += p.submitter.known == peer.known && p.submitter.key == peer.key &&
              (!peer.known || p.submitter.uid == peer.uid);
  }
  if (queued >= opts_.queued_per_user) {
    return send_error(out, rid, req, ErrorCode::NoSpace,
                      "this user has " + std::to_string(queued) +
                          " jobs queued, the limit (queued_per_user " +
                          std::to_string(opts_.queued_per_user) + "); submit more as these start");
  }
  if (!submit->spec()) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument, "SubmitJob without a spec");
  }
  auto spec = std::shared_ptr<proto::JobSpecT>(submit->spec()->UnPack());
  // Sizes are checked against the pool the job may get: its pinned
  // device's, else the largest.
  uint64_t pool_bytes = largest_pool();
  if (auto pin = parse_job_device(spec->device);
      pin && pin->ordinal && devices_.count(*pin->ordinal)) {
    pool_bytes = devices_.at(*pin->ordinal).pool.size;
  }
  try {
    // Everything but the files here; the files are checked off this thread.
    ValidationOptions here{false, pool_bytes, opts_.job_limits};
    here.alignment = devices_.begin()->second.pool.alignment;
    validate_job(*spec, here);
  } catch (const JobSpecError& e) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument, e.what());
  }
  std::string device = spec->device.empty() ? "auto" : spec->device;
  if (!device_fits_any(device)) {
    std::string served;
    for (const auto& [ordinal, dev] : devices_) {
      served += (served.empty() ? "" : ", ") + std::to_string(ordinal);
    }
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "device: job wants '" + spec->device + "' but this coordinator serves " +
                          backend_name(devices_.begin()->second.pool.backend) + " device" +
                          (devices_.size() > 1 ? "s " : " ") + served);
  }
  if (spec->replicas > 1) {
    // One replica per device: more than the devices it may use never start.
    size_t fit = 0;
    for (const auto& [ordinal, dev] : devices_) fit += device_fits(device, dev);
    if (static_cast<size_t>(spec->replicas) > fit) {
      return send_error(out, rid, req, ErrorCode::InvalidArgument,
                        "replicas: " + std::to_string(spec->replicas) +
                            " replicas need as many devices, one each, and this coordinator "
                            "serves " +
                            std::to_string(fit) + " that device '" + device + "' allows");
    }
  }
  uint64_t token = next_check_token_++;
  pending_submits_[token] =
      PendingSubmit{rid, req, spec, now.steady + opts_.file_check_timeout, peer, indexed};
  ValidationOptions files{true, pool_bytes, opts_.job_limits, opts_.state_dir};
  files.alignment = devices_.begin()->second.pool.alignment;
  files.submitter_uid = peer.known ? static_cast<int64_t>(peer.uid) : -1;
  files.submitter_gid = peer.known ? static_cast<int64_t>(peer.gid) : -1;
  out.file_checks.push_back(FileCheck{token, spec, files});
}

void CoordinatorCore::file_check_done(uint64_t token, const std::vector<std::string>& problems,
                                      Now now, Effects& out) {
  now_ = now;
  auto it = pending_submits_.find(token);
  if (it == pending_submits_.end()) return;  // timed out: the client was answered
  PendingSubmit p = std::move(it->second);
  pending_submits_.erase(it);
  if (!problems.empty()) {
    return send_error(out, p.routing_id, p.request_id, ErrorCode::InvalidArgument,
                      JobSpecError(problems).what());
  }
  if (!store_error_.empty()) {
    return send_error(out, p.routing_id, p.request_id, ErrorCode::Unavailable, store_refusal());
  }
  // Checkpoints are on unless the job file turns them off, in a folder of
  // the job's own under the state directory unless it names one.
  if (!p.spec->checkpoint) p.spec->checkpoint = std::make_unique<proto::CheckpointSpecT>();
  auto& ckpt = *p.spec->checkpoint;
  if (ckpt.enabled && ckpt.directory.empty() && !opts_.state_dir.empty()) {
    ckpt.directory = private_checkpoint_dir(jobs_.next_id());
  }
  JobRecord& job =
      jobs_.add(p.spec, now.unix_ms,
                p.submitter.known ? std::optional<uint32_t>(p.submitter.uid) : std::nullopt,
                p.submitter.known ? opts_.access.user_name(p.submitter) : p.submitter.key_user());
  job.checkpoint = checkpoint_file(*p.spec);
  if (!p.key.empty()) {
    job.submit_key = p.key;
    submit_keys_[p.key] = job.id;
  }
  note_shares(job, largest_pool());
  spdlog::info("{} queued (priority {}, checkpoint {})", job_label(job), job.priority,
               job.checkpoint.empty() ? "off" : job.checkpoint);
  proto::JobAcceptedT accepted;
  accepted.job_id = job.id;
  // Released once the job's row is committed.
  send(out, p.routing_id, p.request_id, std::move(accepted), true, job.id);
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
  uint32_t limit =
      l->limit() == 0 ? opts_.list_page_size : std::min(l->limit(), opts_.list_page_size);
  proto::JobListT list;
  auto it = jobs_.all().upper_bound(l->after_id());
  // A page ends at `limit` jobs or at kListPageBytes, whichever comes first
  // (at least one job, and summaries are bounded well below the limit).
  size_t bytes = 0;
  for (; it != jobs_.all().end() && list.jobs.size() < limit && bytes < kListPageBytes; ++it) {
    auto info = job_info(it->second, kSummaryDetail);
    flatbuffers::FlatBufferBuilder one(1024);
    one.Finish(proto::JobInfo::Pack(one, info.get()));
    bytes += one.GetSize();
    list.jobs.push_back(std::move(info));
  }
  list.more = it != jobs_.all().end();
  send(out, rid, env.header()->request_id(), std::move(list));
}

void CoordinatorCore::on_get_job(const std::string& rid, const proto::Envelope& env, Effects& out,
                                 const Peer& peer) {
  uint64_t req = env.header()->request_id();
  uint64_t id = env.body_as_GetJob()->job_id();
  const JobRecord* job = jobs_.find(id);
  if (!job) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "no job with id " + std::to_string(id) +
                          (id < jobs_.next_id() ? " (finished jobs are pruned by retention)" : ""));
  }
  // (Anyone may see a job; its environment's values only whoever may act on it.)
  const bool owner = (peer.known || !peer.key.empty()) && submitted_by(*job, peer);
  const bool admin = owner || !opts_.access.check(Role::Admin, peer);
  send(out, rid, req, std::move(*job_info(*job, admin ? kOwnersDetail : kFullDetail)));
}

void CoordinatorCore::on_cancel(const std::string& rid, const proto::Envelope& env, Now now,
                                Effects& out, const Peer& peer) {
  uint64_t req = env.header()->request_id();
  uint64_t id = env.body_as_CancelJob()->job_id();
  JobRecord* job = jobs_.find(id);
  if (!job) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "no job with id " + std::to_string(id));
  }
  if (auto no = owner_refusal(*job, peer, "cancel")) {
    return send_error(out, rid, req, ErrorCode::PermissionDenied, *no);
  }
  // Every answer waits for the job's row: a cancel sent again while the
  // first one's write is pending is not acknowledged before it is stored.
  out.store_puts.insert(id);
  if (is_terminal(job->state)) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "job " + std::to_string(id) + " already " + job_state_name(job->state), true);
  }
  const std::string who = peer.known          ? opts_.access.user_name(peer)
                          : !peer.key.empty() ? peer.key_user()
                                              : "an unknown user";
  if (job->cancelled_by.empty()) job->cancelled_by = who;
  if (job->state == JobState::Queued) {
    finish(*job, JobState::Cancelled, "cancelled by " + who + " while queued", now, out);
  } else if (!job->cancel_requested) {
    // The agent stops between steps, releases its leases and reports; until
    // its heartbeat shows it stopping, StopJob is sent again.
    job->cancel_requested = true;
    for (const std::string& name : job->gang()) {  // every replica's agent
      auto agent = agents_.find(name);
      if (!job->orphaned_since && agent != agents_.end() && agent->second.job_id == id) {
        push_stop(id, job->attempt_number(), true, "cancelled by " + who, agent->second, out,
                  true);
        job->stop_sent = now.steady;
        job->cancel_since = now.steady;  // its agents have stop_timeout from now
      }
    }
    changed(*job, out);
  }
  spdlog::info("{}: cancel requested by {} ({})", job_label(*job), who, job_state_name(job->state));
  send_ack(out, rid, req, true);
}

// ---- What agents report ----

void CoordinatorCore::on_job_update(const std::string& rid, AgentRecord& agent,
                                    const proto::Envelope& env, Now now, Effects& out) {
  uint64_t req = env.header()->request_id();
  const auto* u = env.body_as_JobUpdate();
  const proto::JobStatus status = u->status();
  const std::string state_text = job_status_name(status);
  // An agent's words: logged, stored and shown in JSON.
  const std::string reason = printable(str(u->reason()), kAgentReasonBytes);
  bool interrupted = status == proto::JobStatus::Interrupted;
  auto state = job_state_of(status);
  if (!interrupted && (!state || *state == JobState::Queued)) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "job update status " + std::to_string(static_cast<int>(status)) + " (" +
                          (state_text.empty() ? "none" : state_text) +
                          ") is not running, succeeded, failed, cancelled or interrupted");
  }
  bool final_report = interrupted || is_terminal(*state);
  JobRecord* job = jobs_.find(u->job_id());
  const int rank = job ? job->rank_on(agent.name) : -1;
  bool ours = job && rank >= 0 && job->attempt_number() == u->attempt() && runs_as(*job, agent);
  std::string what =
      "job " + std::to_string(u->job_id()) + " attempt " + std::to_string(u->attempt());
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
    const AttemptRecord& ended = job->attempts.back();
    bool same =
        ended.outcome == state_text || (ended.outcome == "interrupted" &&
                                        (state_text == "interrupted" || state_text == "cancelled"));
    if (final_report && same) {
      // The same final report again (our acknowledgement was lost or is
      // still waiting for its commit): acknowledge it once that is stored.
      out.store_puts.insert(job->id);
      return send_ack(out, rid, req, true);
    }
    return send_error(
        out, rid, req, ErrorCode::NotOwner,
        what + " has ended (" + ended.outcome + "); its " + state_text + " report is not used");
  }

  // Running, on this agent, this attempt.
  if (rank > 0) {
    // A replica of a data-parallel job: rank 0 reports progress, epochs
    // and the result. Another replica's end matters only when it is not a
    // success: then the gang stops (a failure fails the job; anything else
    // requeues it).
    if (static_cast<size_t>(rank) <= job->replicas_acked.size()) {
      job->replicas_acked[rank - 1] = true;
    }
    const std::string replica = "replica " + std::to_string(rank) + " on agent '" + agent.name + "'";
    if (state && *state == JobState::Succeeded) {
      // Its part is done; the gang goes on until rank 0 reports.
      if (static_cast<size_t>(rank) <= job->replicas_succeeded.size()) {
        job->replicas_succeeded[rank - 1] = true;
      }
      return send_ack(out, rid, req, false);
    }
    if (!final_report) return send_ack(out, rid, req, false);
    if (interrupted && u->device_fault()) {
      on_device_fault(*job, agent, reason, now, out);
    } else if (interrupted && u->replica_lost()) {
      requeue(*job, Interruption::ReplicaLost, replica + ": " + reason, true, now, out);
    } else if (state && *state == JobState::Failed) {
      finish(*job, JobState::Failed, replica + " failed: " + reason, now, out);
    } else if (state && *state == JobState::Cancelled && job->cancel_requested) {
      finish(*job, JobState::Cancelled, reason, now, out);
    } else {
      requeue(*job, Interruption::AgentStopped,
              replica + (reason.empty() ? " was interrupted" : ": " + reason), false, now, out);
    }
    send_ack(out, rid, req, true);
    return schedule(now, out);
  }
  job->assign_acked = true;
  if (job->orphaned_since) {
    job->orphaned_since.reset();
    agent.job_id = job->id;
  }
  bool stored = false, probation_over = false;
  AttemptRecord& attempt = job->attempts.back();
  if (u->resumed_from_epoch() > 0 && attempt.resumed_from_epoch != u->resumed_from_epoch()) {
    attempt.resumed_from_epoch = u->resumed_from_epoch();
    // This attempt runs the epochs after its checkpoint again.
    std::erase_if(job->epochs,
                  [&](const proto::EpochStatT& e) { return e.epoch > attempt.resumed_from_epoch; });
    stored = true;
  }
  if (u->progress()) u->progress()->UnPackTo(&job->progress);
  if (u->memory()) u->memory()->UnPackTo(&job->program_memory);
  if (u->log() && u->log()->size() > 0) {
    // Bounded per message (kJobLogChunkBytes); kept bounded in the job.
    append_log(*job, u->log()->string_view().substr(0, kJobLogChunkBytes), u->log_offset());
  }
  if (final_report && job->is_program()) job->exit_code = u->exit_code();
  if (u->first_step_at_us() && job->first_step_at_us != u->first_step_at_us()) {
    job->first_step_at_us = u->first_step_at_us();
    if (job->fault_suspect) job->probation_since = now.steady;
    stored = true;
  }
  if (u->epoch()) {
    proto::EpochStatT e;
    u->epoch()->UnPackTo(&e);
    auto pos = std::find_if(job->epochs.begin(), job->epochs.end(),
                            [&](const proto::EpochStatT& x) { return x.epoch >= e.epoch; });
    if (pos != job->epochs.end() && pos->epoch == e.epoch) {
      *pos = e;  // sent again, or run again after a resume
    } else {
      job->epochs.insert(pos, e);
      if (job->epochs.size() > opts_.epochs_kept) {
        // Bounded: every stored write and every reply carries them.
        const size_t drop = job->epochs.size() - opts_.epochs_kept;
        job->epochs.erase(job->epochs.begin(),
                          job->epochs.begin() + static_cast<std::ptrdiff_t>(drop));
        job->epochs_dropped += static_cast<uint32_t>(drop);
      }
    }
    stored = true;
    // A whole epoch of this attempt (not the checkpointed one a resume
    // reports again) trained without a fault.
    if (job->fault_suspect && job->first_step_at_us && e.epoch > attempt.resumed_from_epoch) {
      set_suspect(*job, false);
      job->probation_since.reset();
      spdlog::info("{}: epoch {} done without a device fault; others may run beside it",
                   job_label(*job), e.epoch);
      probation_over = true;
    }
  }
  if (interrupted && u->device_fault()) {
    on_device_fault(*job, agent, reason, now, out);
  } else if (interrupted && u->replica_lost()) {
    // Counted: a gang that cannot connect (or keep connected) must not
    // retry forever. When a replica's agent died, its loss usually reaches
    // the coordinator first and this report then comes too late to count.
    requeue(*job, Interruption::ReplicaLost,
            "rank 0 on agent '" + agent.name + "': " + reason, true, now, out);
  } else if (interrupted) {
    // An orphan's agent came back to report the end its loss caused.
    requeue(*job, job->orphaned_since ? job->orphan_kind : Interruption::AgentStopped,
            reason.empty() ? "interrupted on agent '" + agent.name + "'" : reason, false, now, out);
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
      requeue(*job, Interruption::AgentStopped,
              reason.empty() ? "stopped by agent '" + agent.name + "'" : reason, false, now, out);
    } else {
      finish(*job, *state, reason, now, out);
    }
  }
  // Epoch reports and results are acknowledged once stored; progress at once.
  send_ack(out, rid, req, stored || final_report);
  if (final_report || probation_over) schedule(now, out);
}

}  // namespace leasehold
