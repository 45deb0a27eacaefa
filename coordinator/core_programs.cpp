// The core's program jobs (JobSpec.program): the sessions their processes
// register (bound to the job's attempt by a token, their leases the job's
// and within its budget), and their output, kept as the job's log.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/core.h"
#include "coordinator/replies.h"
#include "shared/printable.h"
#include "shared/units.h"

namespace leasehold {

std::optional<std::string> CoordinatorCore::program_session_refusal(
    const proto::Register& r, const std::string& name, const std::string& identity) const {
  const std::string what = "job " + std::to_string(r.job_id());
  const JobRecord* job = jobs_.find(r.job_id());
  if (!job || !job->is_program()) return what + " is not a program job of this coordinator";
  if (job->state != JobState::Running || job->attempt_number() != r.attempt()) {
    return what + " attempt " + std::to_string(r.attempt()) + " is not running";
  }
  // The token only the attempt's agent was given, for its program.
  if (job->program_token.empty() ||
      job->program_token != SessionToken{r.job_token_lo(), r.job_token_hi()}) {
    return "the session token of " + what + " attempt " + std::to_string(r.attempt()) + " is wrong";
  }
  // Each replica's process registers its own session, named after the
  // agent that runs it.
  const std::string suffix = ":job" + std::to_string(job->id);
  const bool named = name.size() > suffix.size() && name.ends_with(suffix) &&
                     job->rank_on(name.substr(0, name.size() - suffix.size())) >= 0;
  if (!named) {
    return what + "'s session must be named '" + job->agent + suffix + "', not '" + name + "'";
  }
  const std::string runner = name.substr(0, name.size() - suffix.size());
  std::string agent_identity = job->attempts.back().agent_identity;
  if (runner != job->agent) {
    auto it = agents_.find(runner);
    agent_identity = it == agents_.end() ? "" : it->second.identity;
  }
  if (!agent_identity.empty() && agent_identity != identity) {
    return what + "'s session must run as its agent does (" + agent_identity + ")";
  }
  return std::nullopt;
}

std::optional<std::string> CoordinatorCore::budget_refusal(const AgentRecord& agent,
                                                           uint64_t bytes) const {
  if (!agent.program_job) return std::nullopt;
  const JobRecord* job = jobs_.find(agent.program_job);
  if (!job || !job->spec)
    return "its program job " + std::to_string(agent.program_job) + " is gone";
  if (!is_current(*job, agent)) {
    return "attempt " + std::to_string(agent.program_attempt) + " of job " +
           std::to_string(job->id) + " is over";
  }
  const uint64_t budget = job->budget_bytes;
  const DeviceState& dev = device_of(agent);
  const auto owner = LeaseOwner::agent(agent.name);
  uint64_t held = dev.leases.leased_bytes(owner);
  for (const auto& w : dev.leases.waiting_requests()) held += w.owner == owner ? w.size : 0;
  // (Sizes near 2^64 must not wrap round to a small request.)
  const uint64_t alignment = dev.pool.alignment;
  const uint64_t asked =
      bytes > budget ? budget + 1 : (bytes + alignment - 1) / alignment * alignment;
  if (held <= budget && asked <= budget - held) return std::nullopt;
  return "job " + std::to_string(job->id) + "'s memory_budget of " + format_bytes(budget) +
         " would be exceeded: " + format_bytes(held) + " leased or asked for, " +
         format_bytes(bytes) + " more asked";
}

bool CoordinatorCore::is_current(const JobRecord& job, const AgentRecord& session) {
  return job.state == JobState::Running && job.attempt_number() == session.program_attempt;
}

void CoordinatorCore::end_program_session(const JobRecord& job, const std::string& why, Now now,
                                          Effects& out) {
  // Its processes may still run (an agent was lost, or they outlive their
  // attempt): their leases are fenced until they exit, as a silent agent's,
  // and the next attempt's sessions start afresh within the budget.
  std::vector<std::string> names;
  auto [from, to] = program_sessions_.equal_range(job.id);
  for (auto it = from; it != to; ++it) names.push_back(it->second);
  for (const auto& name : names) drop_agent(name, why, JobFate::Silent, now, out);
}

const JobRecord* CoordinatorCore::managed_job(const AgentRecord& agent) const {
  const JobRecord* job = agent.memory_job() ? jobs_.find(agent.memory_job()) : nullptr;
  if (!job || job->state != JobState::Running) return nullptr;
  if (agent.program_job) return is_current(*job, agent) ? job : nullptr;
  // An agent running a program job whose session is registered holds none
  // of its memory: the session does.
  if (job->rank_on(agent.name) < 0) return nullptr;
  auto [from, to] = program_sessions_.equal_range(job->id);
  for (auto it = from; it != to; ++it) {
    if (it->second == agent.name + ":job" + std::to_string(job->id)) return nullptr;
  }
  return job;
}

void CoordinatorCore::append_log(JobRecord& job, std::string_view chunk, uint64_t offset) {
  // Chunks come in order, and one sent again (its acknowledgement was
  // lost) overlaps what arrived: only the new part is kept.
  if (offset > job.attempt_log_bytes) {
    const std::string gap = "\n[leasehold: " + std::to_string(offset - job.attempt_log_bytes) +
                            " bytes of output were lost]\n";
    job.log += gap;
    job.log_bytes += gap.size();
    job.attempt_log_bytes = offset;
  }
  const uint64_t skip = job.attempt_log_bytes - offset;
  if (skip >= chunk.size()) return;
  chunk.remove_prefix(skip);
  job.log.append(chunk.data(), chunk.size());
  job.log_bytes += chunk.size();
  job.attempt_log_bytes += chunk.size();
  if (job.log.size() > kJobLogBytes) job.log.erase(0, job.log.size() - kJobLogBytes);
}

void CoordinatorCore::on_get_job_log(const std::string& rid, const proto::Envelope& env,
                                     Effects& out, const Peer& peer) {
  const uint64_t req = env.header()->request_id();
  const auto* g = env.body_as_GetJobLog();
  const JobRecord* job = jobs_.find(g->job_id());
  if (!job) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "no job with id " + std::to_string(g->job_id()));
  }
  // A program's output may hold anything its owner printed: theirs (and
  // administrators') to read.
  if (auto no = owner_refusal(*job, peer, "read the log of")) {
    return send_error(out, rid, req, ErrorCode::PermissionDenied, *no);
  }
  proto::JobLogT log;
  log.job_id = job->id;
  log.total = job->log_bytes;
  log.first_kept = job->log_bytes - job->log.size();
  log.offset = std::clamp(g->offset(), log.first_kept, log.total);
  // A reply stays far below the protocol's message size.
  const uint64_t limit =
      std::min<uint64_t>(g->limit() ? g->limit() : kJobLogReplyBytes, kJobLogReplyBytes);
  log.data = job->log.substr(log.offset - log.first_kept, limit);
  log.finished = is_terminal(job->state);
  send(out, rid, req, std::move(log));
}

}  // namespace leasehold
