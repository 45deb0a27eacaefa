// The core's side of the occupancy policy: the PoolView the policy decides
// on, Shrink requests and their answers, deadlines, and the time jobs spend
// waiting for memory. The rules themselves are the policy's
// (coordinator/occupancy_policy.h).
#include <spdlog/spdlog.h>

#include "coordinator/core.h"
#include "coordinator/replies.h"
#include "shared/job_spec.h"
#include "shared/printable.h"
#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold {
namespace {

// Publishes a Shrink or ShrinkDone on the agent's topic.
template <class T>
void publish_shrink(Effects& out, const std::string& agent, T body) {
  Notice n;
  n.topic = "shrink." + agent + ".";
  n.body.Set(std::move(body));
  out.notices.push_back(std::move(n));
}

}  // namespace

void CoordinatorCore::note_shares(JobRecord& job, uint64_t pool_size) {
  try {
    if (!job.spec) throw std::runtime_error("no spec");
    auto buffer = pack_job_spec(*job.spec);
    job.guaranteed_bytes = job_memory_min(*verify_job(buffer), pool_size);
    job.budget_bytes = job_memory_budget(*verify_job(buffer), pool_size);
  } catch (const std::exception&) {
    // Validated at submission; a stored spec this build cannot read asks
    // for the whole pool rather than nothing.
    job.guaranteed_bytes = job.budget_bytes = pool_size;
  }
}

PoolView CoordinatorCore::pool_view(const DeviceState& dev) const {
  PoolView view;
  view.pool_size = dev.pool.size;
  view.used = dev.leases.allocator().used_bytes();
  view.largest_free = dev.leases.allocator().largest_free();
  view.evictable = dev.regions.evictable_bytes();
  std::map<std::string, uint64_t> held;
  for (const auto& [id, rec] : dev.leases.leases()) {
    if (rec.owner.is_agent()) held[rec.owner.name] += rec.size;
  }
  for (const auto& [name, agent] : agents_) {  // in name order
    if (agent.device != dev.ordinal()) continue;
    AgentShare a;
    a.name = name;
    a.leased = held[name];
    if (const JobRecord* job = managed_job(agent)) {
      a.job_id = job->id;
      a.priority = job->priority;
      a.guaranteed = job->guaranteed_bytes;
      a.shrinkable = !agent.shrink && now_.steady >= agent.shrink_rest_until &&
                     !job->cancel_requested && !job->stop_wanted && !job->orphaned_since;
    }
    if (agent.shrink) a.shrink_pending = agent.shrink->missed ? 0 : agent.shrink->bytes;
    view.agents.push_back(std::move(a));
  }
  view.waiting.assign(dev.leases.waiting_requests().begin(), dev.leases.waiting_requests().end());
  return view;
}

void CoordinatorCore::request_shrinks(Now now, Effects& out) {
  std::vector<ShrinkOrder> orders;
  for (const auto& [ordinal, dev] : devices_) {
    for (auto& order : policy_->shrinks(pool_view(dev))) orders.push_back(std::move(order));
  }
  for (const ShrinkOrder& order : orders) {
    auto it = agents_.find(order.agent);
    if (it == agents_.end() || it->second.shrink || !it->second.memory_job()) continue;
    AgentRecord& agent = it->second;
    AgentRecord::PendingShrink s;
    s.id = next_shrink_id_++;
    s.job_id = agent.memory_job();
    s.bytes = order.bytes;
    s.sent = now.steady;
    s.deadline = now.steady + opts_.shrink_timeout;
    agent.shrink = s;
    agent.last_shrink_id = s.id;

    proto::ShrinkT msg;
    msg.id = s.id;
    msg.agent = agent.name;
    msg.session = agent.session.lo;
    msg.session_hi = agent.session.hi;
    msg.job_id = s.job_id;
    msg.bytes = s.bytes;
    msg.deadline_ms = static_cast<uint32_t>(opts_.shrink_timeout.count());
    msg.reason = order.reason;
    for (const auto& rid : agent.routing_ids) send(out, rid, 0, proto::ShrinkT(msg));
    // Subscribers see who is asked and why, never the token.
    msg.session = msg.session_hi = 0;
    publish_shrink(out, agent.name, std::move(msg));
    spdlog::info("asked agent '{}' (job {}) to shrink by {} within {} ms: {}", agent.name, s.job_id,
                 format_bytes(s.bytes), opts_.shrink_timeout.count(), order.reason);
  }
}

void CoordinatorCore::on_shrink_done(const std::string& rid, AgentRecord& agent,
                                     const proto::Envelope& env, Now now, Effects& out) {
  uint64_t req = env.header()->request_id();
  const auto* d = env.body_as_ShrinkDone();
  if (!agent.shrink || agent.shrink->id != d->id()) {
    if (d->id() != 0 && d->id() <= agent.last_shrink_id) {
      // An answer to a Shrink whose job has ended since: nothing to do.
      return send_ack(out, rid, req);
    }
    return send_error(
        out, rid, req, ErrorCode::NotOwner,
        "shrink " + std::to_string(d->id()) + " was not asked of agent '" + agent.name + "'");
  }
  AgentRecord::PendingShrink s = *agent.shrink;
  agent.shrink.reset();
  ++agent.shrinks_answered;
  agent.shrinks_missed = 0;
  const uint64_t released = d->released();
  // Less than asked: what it holds is in use now; let it run a while.
  if (released < s.bytes) agent.shrink_rest_until = now.steady + opts_.heartbeat_interval;
  const std::string reason = printable(str(d->reason()), kAgentReasonBytes);
  spdlog::info("agent '{}' released {} of {} asked in {} ms{}{}", agent.name,
               format_bytes(released), format_bytes(s.bytes), ms_between(s.sent, now.steady),
               reason.empty() ? "" : ": ", reason);
  bool stored = false;
  if (JobRecord* job = jobs_.find(s.job_id)) {
    ++job->shrinks;
    job->shrunk_bytes += released;
    changed(*job, out);
    stored = true;
  }
  proto::ShrinkDoneT echo;
  d->UnPackTo(&echo);
  publish_shrink(out, agent.name, std::move(echo));
  send_ack(out, rid, req, stored);
  serve_waiting(out);
  request_shrinks(now, out);
}

void CoordinatorCore::check_shrinks(Now now, Effects& out) {
  std::vector<std::pair<std::string, std::shared_ptr<AgentProcess>>> silent;
  for (auto& [name, agent] : agents_) {
    if (!agent.shrink) continue;
    AgentRecord::PendingShrink& s = *agent.shrink;
    if (!s.missed && now.steady >= s.deadline) {
      s.missed = true;
      ++agent.shrinks_missed;
      spdlog::warn("agent '{}' did not answer shrink {} ({}) within {} ms; skipping it", name, s.id,
                   format_bytes(s.bytes), opts_.shrink_timeout.count());
      proto::ShrinkDoneT missed;
      missed.id = s.id;
      missed.reason =
          "no answer within " + std::to_string(opts_.shrink_timeout.count()) + " ms; skipped";
      publish_shrink(out, name, std::move(missed));
    } else if (s.missed && now.steady >= s.deadline + opts_.shrink_timeout) {
      silent.emplace_back(name, agent.process);
    }
  }
  for (const auto& [name, process] : silent) {
    std::string why = "did not answer a Shrink for " +
                      std::to_string(2 * opts_.shrink_timeout.count()) + " ms (unresponsive)";
    uint64_t job_id = agents_.at(name).job_id;
    // Like an agent that stopped heart-beating: if its process lives it may
    // still write into its leases, so they are fenced.
    drop_agent(name, why, gone(process) ? JobFate::AgentLost : JobFate::Silent, now, out);
    // Its report of the interruption cannot say why: the job record does.
    if (JobRecord* job = job_id ? jobs_.find(job_id) : nullptr; job && job->orphaned_since) {
      job->orphan_cause = "agent '" + name + "' " + why;
    }
  }
  if (!silent.empty()) {
    serve_waiting(out);
    schedule(now, out);
  }
}

void CoordinatorCore::note_lease_wait(const LeaseOwner& owner, Clock::time_point since, Now now,
                                      Effects& out) {
  uint64_t waited = ms_between(since, now.steady);
  if (waited == 0 || !owner.is_agent()) return;
  auto it = agents_.find(owner.name);
  if (it == agents_.end() || !it->second.memory_job()) return;
  JobRecord* job = jobs_.find(it->second.memory_job());
  if (!job || job->state != JobState::Running) return;
  job->memory_wait_ms += waited;
  changed(*job, out);
}

void CoordinatorCore::end_memory_wait(JobRecord& job, Now now) {
  if (!job.waiting_since) return;
  job.memory_wait_ms += ms_between(*job.waiting_since, now.steady);
  job.waiting_since.reset();
}

void CoordinatorCore::note_waiting(JobRecord* head, const Pick& refused, Now now, Effects& out) {
  // The job first in line before, if it still waits behind another now
  // (one of higher priority came), waits behind again; the others always
  // do (JobTable::kBehind), so a new head changes two jobs, not the queue.
  if (head_ && (!head || head->id != head_)) {
    JobRecord* old = jobs_.find(head_);
    if (old && old->state == JobState::Queued) {
      if (old->waiting_since) {
        end_memory_wait(*old, now);
        changed(*old, out);
      }
      if (old->waiting_for != JobTable::kBehind) {
        old->waiting_for = JobTable::kBehind;
        out.events.push_back(old->id);
      }
    }
  }
  head_ = head ? head->id : 0;
  if (!head) return;
  JobRecord& job = *head;
  const bool for_memory = !refused.waiting_for.empty();
  std::string why = for_memory ? refused.waiting_for : "waiting for an idle agent";
  if (for_memory && !job.waiting_since) job.waiting_since = now.steady;
  if (!for_memory && job.waiting_since) {
    end_memory_wait(job, now);
    changed(job, out);
  }
  if (why != job.waiting_for) {
    job.waiting_for = std::move(why);
    out.events.push_back(job.id);  // published, not stored
  }
}

}  // namespace leasehold
