// The core's message dispatch, leases and status: heart-beats, lease
// requests and their waits, the periodic tick. Agents' registration and
// end are in core_agents.cpp, jobs in core_jobs.cpp.
#include "coordinator/core.h"

#include <spdlog/spdlog.h>

#include <stdexcept>

#include "coordinator/replies.h"
#include "shared/printable.h"
#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold {
namespace {

PoolAllocator::End to_end(proto::LeaseEnd e) {
  return e == proto::LeaseEnd::High ? PoolAllocator::End::High : PoolAllocator::End::Low;
}

}  // namespace

CoordinatorCore::CoordinatorCore(CoreOptions options, std::vector<PoolDescriptor> pools,
                                 std::unique_ptr<SchedulingPolicy> policy, Now now)
    : opts_(std::move(options)), policy_(std::move(policy)), now_(now), started_(now.steady) {
  if (!opts_.follow_process) throw std::invalid_argument("CoreOptions.follow_process is required");
  if (pools.empty()) throw std::invalid_argument("the coordinator needs at least one pool");
  for (size_t i = 0; i < pools.size(); ++i) {
    PoolDescriptor& pool = pools[i];
    if (pool.backend != pools.front().backend) {
      throw std::invalid_argument("every pool must be of one backend");
    }
    const int ordinal = pool.device;
    if (!devices_.try_emplace(ordinal, std::move(pool), i, pools.size()).second) {
      throw std::invalid_argument("device " + std::to_string(ordinal) + " is given twice");
    }
  }
  jobs_.set_history_kept(opts_.history_kept);
}

std::string CoordinatorCore::summary() const {
  size_t leases = 0;
  uint64_t used = 0, size = 0;
  for (const auto& [ordinal, dev] : devices_) {
    leases += dev.leases.leases().size();
    used += dev.leases.allocator().used_bytes();
    size += dev.leases.allocator().pool_size();
  }
  const size_t queued = jobs_.queue().size(), running = jobs_.running().size();
  return std::to_string(agents_.size()) + " agents, " + std::to_string(leases) + " leases, " +
         format_bytes(used) + " of " + format_bytes(size) + " leased" +
         (devices_.size() > 1 ? " on " + std::to_string(devices_.size()) + " devices" : "") + ", " +
         std::to_string(queued) + " jobs queued, " + std::to_string(running) + " running";
}

uint64_t CoordinatorCore::largest_pool() const {
  uint64_t largest = 0;
  for (const auto& [ordinal, dev] : devices_) largest = std::max(largest, dev.pool.size);
  return largest;
}

void CoordinatorCore::handle(const std::string& routing_id, const proto::Envelope& request, Now now,
                             Effects& out, const Peer& peer) {
  now_ = now;
  try {
    dispatch(routing_id, request, now, out, peer);
  } catch (const std::exception& e) {
    // A bug or a resource failure while serving one request must not take
    // the coordinator down; the peer learns what happened.
    spdlog::error("internal error while serving a request: {}", e.what());
    send_error(out, routing_id, request.header()->request_id(), ErrorCode::Internal,
               std::string("internal error: ") + e.what());
  }
}

void CoordinatorCore::dispatch(const std::string& rid, const proto::Envelope& env, Now now,
                               Effects& out, const Peer& peer) {
  const auto* hdr = env.header();
  uint64_t req = hdr->request_id();
  switch (env.body_type()) {
    case proto::Body::Register:
      return on_register(rid, env, now, out, peer);
    case proto::Body::StatusRequest:
      return on_status(rid, req, now, out);
    case proto::Body::SubmitJob:
      return on_submit(rid, env, now, out, peer);
    case proto::Body::ListJobs:
      return on_list_jobs(rid, env, out);
    case proto::Body::GetJob:
      return on_get_job(rid, env, out, peer);
    case proto::Body::GetJobLog:
      return on_get_job_log(rid, env, out, peer);
    case proto::Body::GetCheckpoint:
      return on_get_checkpoint(rid, env, now, out, peer);
    case proto::Body::CancelJob:
      return on_cancel(rid, env, now, out, peer);
    case proto::Body::ListRegions:
      return on_list_regions(rid, req, out);
    case proto::Body::DropRegion:
      return on_drop_region(rid, env, now, out, peer);
    case proto::Body::AttachRegion:
    case proto::Body::RegionReady:
    case proto::Body::DetachRegion:
    case proto::Body::JobUpdate:
    case proto::Body::Heartbeat:
    case proto::Body::Unregister:
    case proto::Body::LeaseRequest:
    case proto::Body::LeaseResize:
    case proto::Body::LeaseRelease:
    case proto::Body::ShrinkDone:
      break;
    default:
      return send_error(out, rid, req, ErrorCode::Malformed,
                        std::string("message type ") + proto::EnumNameBody(env.body_type()) +
                            " is not a request the coordinator serves");
  }

  // Everything below needs a registered agent presenting its session token.
  std::string name(str(hdr->sender()));
  auto it = agents_.find(name);
  if (it == agents_.end() ||
      it->second.session != SessionToken{hdr->session(), hdr->session_hi()}) {
    return send_error(out, rid, req, ErrorCode::UnknownSender,
                      "agent '" + printable(name, 128) +
                          "' is not registered with this coordinator (it may have restarted); "
                          "register first");
  }
  AgentRecord& agent = it->second;
  if (agent.late) {
    spdlog::info("agent '{}' is heard again after {} ms of silence", name,
                 ms_between(agent.last_seen, now.steady));
    agent.late = false;
  }
  agent.last_seen = now.steady;  // also ends the first-heartbeat grace
  if (agent.routing_ids.insert(rid).second && agent.routing_ids.size() > 4) {
    agent.routing_ids.erase(agent.routing_ids.begin());
  }

  switch (env.body_type()) {
    case proto::Body::Heartbeat: {
      const auto* hb = env.body_as_Heartbeat();
      if (auto no = reported_jobs_refusal(hb->jobs())) {
        return send_error(out, rid, req, ErrorCode::InvalidArgument, *no);
      }
      if (hb->ready() && !agent.ready) {
        spdlog::info("agent '{}' is warmed up and stands by ({} of device memory outside the pool)",
                     name, format_bytes(hb->outside_pool_bytes()));
      }
      agent.ready = hb->ready();
      agent.outside_pool_bytes = hb->outside_pool_bytes();
      agent.stale_holds = hb->stale_holds();
      reconcile(agent, nullptr, hb, now, out);
      proto::HeartbeatAckT ack;
      ack.coordinator_instance_lo = instance_.lo;
      ack.coordinator_instance_hi = instance_.hi;
      send(out, rid, req, std::move(ack));
      return schedule(now, out);
    }
    case proto::Body::AttachRegion:
      return on_attach_region(rid, agent, env, now, out);
    case proto::Body::RegionReady:
      return on_region_ready(rid, agent, env, now, out);
    case proto::Body::DetachRegion:
      return on_detach_region(rid, agent, env, now, out);
    case proto::Body::Unregister:
      drop_agent(name, "unregistered", JobFate::Requeue, now, out);
      send_ack(out, rid, req);
      serve_waiting(out);
      return schedule(now, out);
    case proto::Body::LeaseRequest:
      return on_lease_request(rid, agent, env, now, out);
    case proto::Body::JobUpdate:
      return on_job_update(rid, agent, env, now, out);
    case proto::Body::ShrinkDone:
      return on_shrink_done(rid, agent, env, now, out);
    case proto::Body::LeaseResize: {
      const auto* r = env.body_as_LeaseResize();
      DeviceState& dev = device_of(agent);
      const auto owner = LeaseOwner::agent(name);
      if (auto held = dev.leases.leases().find(r->lease_id()); held != dev.leases.leases().end() &&
                                                               held->second.owner == owner &&
                                                               r->size() > held->second.size) {
        if (auto no = budget_refusal(agent, r->size() - held->second.size)) {
          return send_error(out, rid, req, ErrorCode::NoSpace, "resize refused: " + *no);
        }
      }
      if (auto held = dev.leases.leases().find(r->lease_id());
          agent.program_job != 0 && held != dev.leases.leases().end() &&
          held->second.owner == owner && r->size() < held->second.size) {
        // What it gives back must get new memory first, which is done
        // per lease (core_renewals.cpp): it releases a lease instead.
        return send_error(out, rid, req, ErrorCode::InvalidArgument,
                          "a program job's session cannot shrink a lease; release it instead");
      }
      auto result = dev.leases.resize(owner, r->lease_id(), r->size());
      if (auto* refusal = std::get_if<Refusal>(&result)) {
        return send_error(out, rid, req, refusal->code, refusal->message);
      }
      proto::LeaseGrantT grant;
      grant.lease = lease_object(std::get<LeaseRecord>(result), dev.ordinal());
      send(out, rid, req, std::move(grant));
      return serve_waiting(dev, out);
    }
    case proto::Body::LeaseRelease: {
      const auto* r = env.body_as_LeaseRelease();
      DeviceState& dev = device_of(agent);
      auto given = give_back(dev, LeaseOwner::agent(name), agent.program_job != 0, name,
                             r->lease_id());
      if (auto* refusal = std::get_if<Refusal>(&given)) {
        return send_error(out, rid, req, refusal->code, refusal->message);
      }
      send_ack(out, rid, req);
      return serve_waiting(dev, out);
    }
    default:
      return;
  }
}

std::optional<Refusal> CoordinatorCore::wait_refusal(const std::string& agent,
                                                     int64_t wait_ms) const {
  if (wait_ms <= 0) return std::nullopt;
  if (wait_ms > opts_.max_lease_wait.count()) {
    return Refusal{ErrorCode::InvalidArgument, "a wait of " + std::to_string(wait_ms) +
                                                   " ms is longer than the limit (max_lease_wait " +
                                                   std::to_string(opts_.max_lease_wait.count()) +
                                                   " ms)"};
  }
  size_t waiting = 0;
  const auto owner = LeaseOwner::agent(agent);
  for (const auto& [ordinal, dev] : devices_) {
    for (const auto& w : dev.leases.waiting_requests()) waiting += w.owner == owner;
    for (const auto& w : dev.regions.waiters()) waiting += w.agent == agent;
  }
  if (waiting >= opts_.waiting_per_agent) {
    return Refusal{ErrorCode::NoSpace, "agent '" + agent + "' has " + std::to_string(waiting) +
                                           " requests waiting, the limit (waiting_per_agent " +
                                           std::to_string(opts_.waiting_per_agent) + ")"};
  }
  return std::nullopt;
}

void CoordinatorCore::on_lease_request(const std::string& rid, AgentRecord& agent,
                                       const proto::Envelope& env, Now now, Effects& out) {
  const auto* r = env.body_as_LeaseRequest();
  uint64_t req = env.header()->request_id();
  int64_t wait_ms = r->wait_ms() < 0 ? opts_.lease_wait_timeout.count() : r->wait_ms();
  DeviceState& dev = device_of(agent);
  if (auto no = wait_refusal(agent.name, wait_ms)) {
    ++dev.stats.refusals;
    return send_error(out, rid, req, no->code,
                      "lease of " + format_bytes(r->size()) + " refused: " + no->message);
  }
  if (auto no = budget_refusal(agent, r->size())) {
    ++dev.stats.refusals;
    return send_error(out, rid, req, ErrorCode::NoSpace,
                      "lease of " + format_bytes(r->size()) + " refused: " + *no);
  }
  PendingRequest pending{LeaseOwner::agent(agent.name),
                         r->size(),
                         to_end(r->end()),
                         now.steady + std::chrono::milliseconds(wait_ms),
                         {rid, req},
                         now.steady,
                         r->needed()};
  auto outcome = dev.leases.request(
      pending, wait_ms > 0, [this, &dev](const PendingRequest& p) { return admit(dev, p); });
  if (auto* refusal = std::get_if<Refusal>(&outcome)) {
    ++dev.stats.refusals;
    spdlog::info("lease of {} for '{}' refused: {}", format_bytes(r->size()), agent.name,
                 refusal->message);
    return send_error(out, rid, req, refusal->code, refusal->message);
  }
  if (std::holds_alternative<LeaseTable::Queued>(outcome)) {
    spdlog::info("lease of {} for '{}' waits up to {} ms for memory", format_bytes(r->size()),
                 agent.name, wait_ms);
    // Idle cache regions go first (serve_waiting evicts them); then memory
    // held past guaranteed shares may have to come back for it.
    serve_waiting(dev, out);
    return request_shrinks(now, out);
  }
  const auto& rec = std::get<LeaseRecord>(outcome);
  dev.stats.granted(0);
  spdlog::debug("lease {} granted to '{}': offset {} size {}", rec.id, agent.name, rec.offset,
                rec.size);
  proto::LeaseGrantT grant;
  grant.lease = lease_object(rec, dev.ordinal());
  send(out, rid, req, std::move(grant));
}

bool CoordinatorCore::admit(const DeviceState& dev, const PendingRequest& request) {
  // Built for each request: a grant changes what the next one sees.
  return policy_->may_grant(request, pool_view(dev));
}

void CoordinatorCore::serve_waiting(Effects& out) {
  for (auto& [ordinal, dev] : devices_) serve_waiting(dev, out);
}

void CoordinatorCore::serve_waiting(DeviceState& dev, Effects& out) {
  while (true) {
    for (const auto& g : dev.leases.grant_waiting(
             [this, &dev](const PendingRequest& p) { return admit(dev, p); })) {
      spdlog::info("waiting lease of {} granted to {} (lease {})", format_bytes(g.lease.size),
                   g.lease.owner.describe(), g.lease.id);
      proto::LeaseGrantT grant;
      grant.lease = lease_object(g.lease, dev.ordinal());
      send(out, g.reply_to.routing_id, g.reply_to.request_id, std::move(grant));
      dev.stats.granted(
          std::chrono::duration<double>(std::max(now_.steady - g.since, Clock::duration{}))
              .count());
      note_lease_wait(g.lease.owner, g.since, now_, out);
    }
    // Requests still waiting need memory: idle cache regions give it up
    // first, least recently used first, before anyone is asked to shrink
    // (not for speculative growth, nor when even all of them would not do).
    if (dev.leases.waiting() == 0 || !eviction_could_serve(dev)) return;
    RegionRecord* idle = dev.regions.least_recently_used();
    if (!idle) return;
    evict_region(*idle, std::to_string(dev.leases.waiting()) + " lease request(s) wait for memory",
                 now_);
  }
}

void CoordinatorCore::on_status(const std::string& rid, uint64_t req, Now now, Effects& out) {
  send(out, rid, req, status(now));
}

proto::StatusReplyT CoordinatorCore::status(Now now) const {
  proto::StatusReplyT status;
  // Per-holder totals in one pass over every device's leases.
  std::map<LeaseOwner, std::pair<uint64_t, uint32_t>> held;
  std::map<std::string, const AgentShare*> shares;
  std::vector<PoolView> views;
  views.reserve(devices_.size());
  for (const auto& [ordinal, dev] : devices_) {
    const auto& alloc = dev.leases.allocator();
    auto d = std::make_unique<proto::DeviceStatusT>();
    d->pool = std::make_unique<proto::PoolUsageT>();
    d->pool->info = pool_info_object(dev.pool);
    d->pool->used_bytes = alloc.used_bytes();
    d->pool->free_bytes = alloc.free_bytes();
    d->pool->largest_free_bytes = alloc.largest_free();
    d->pool->free_blocks = static_cast<uint32_t>(alloc.free_block_count());
    for (const auto& [id, rec] : dev.leases.leases()) {
      auto& h = held[rec.owner];
      h.first += rec.size;
      h.second += 1;
      status.leases.push_back(lease_object(rec, ordinal));
    }
    const PoolView& view = views.emplace_back(pool_view(dev));
    for (const auto& s : view.agents) shares[s.name] = &s;
    auto& occ = d->occupancy = std::make_unique<proto::OccupancyT>();
    occ->policy = policy_->name();
    occ->occupancy = view.occupancy();
    occ->occupancy_future = view.occupancy_future();
    occ->low_watermark = policy_->low_watermark();
    occ->high_watermark = policy_->high_watermark();
    occ->reserved_bytes = view.reserved();
    occ->reclaimable_bytes = view.reclaimable();
    for (const auto& s : view.agents) occ->guaranteed_bytes += s.managed() ? s.guaranteed : 0;
    for (const auto& [n, agent] : agents_) {
      if (agent.device != ordinal) continue;
      occ->shrinks_pending += agent.shrink.has_value();
      d->agents += 1;
      d->standby_agents += agent.idle();
    }
    d->pending_requests = static_cast<uint32_t>(dev.leases.waiting());
    status.devices.push_back(std::move(d));
  }
  for (const auto& [name, agent] : agents_) {
    auto [bytes, count] = held[LeaseOwner::agent(name)];
    const AgentShare* share = shares.count(name) ? shares[name] : nullptr;
    auto a = std::make_unique<proto::AgentInfoT>();
    a->name = name;
    a->pid = agent.pid;
    a->device = agent.device;
    a->state = agent.state(count);
    a->outside_pool_bytes = agent.outside_pool_bytes;
    a->mps_thread_percentage = agent.mps_thread_percentage;
    a->leased_bytes = bytes;
    a->lease_count = count;
    // last_seen is in the future while an agent is within its first-heartbeat grace.
    a->last_heartbeat_ms_ago = ms_between(agent.last_seen, now.steady);
    a->job_id = agent.memory_job();  // its job, or its program job's
    a->guaranteed_bytes = share ? share->guaranteed : 0;
    a->shrink_pending_bytes = agent.shrink ? agent.shrink->bytes : 0;
    a->shrinks = agent.shrinks_answered;
    a->missed_shrinks = agent.shrinks_missed;
    status.agents.push_back(std::move(a));
  }
  status.uptime_ms = ms_between(started_, now.steady);
  status.mps_pipe_directory = opts_.mps_pipe_directory;
  for (const auto& [agent, f] : fences_) {
    auto info = std::make_unique<proto::FenceInfoT>();
    info->agent = agent;
    info->pid = f.pid;
    info->device = f.device;
    auto [bytes, count] = held[LeaseOwner::fenced(agent)];
    info->lease_count = count;
    info->bytes = bytes;
    info->since_ms_ago = ms_between(f.since, now.steady);
    info->state = fence_state(agent, f, now);
    status.fences.push_back(std::move(info));
  }
  return status;
}

void CoordinatorCore::tick(Now now, Effects& out) {
  now_ = now;
  purge_dead_agents(now, out);
  check_shrinks(now, out);
  check_fences(now, out);
  for (auto& [ordinal, dev] : devices_) {
    for (auto& e : dev.leases.expire(now.steady)) {
      ++dev.stats.timeouts;
      send_error(out, e.reply_to.routing_id, e.reply_to.request_id, e.refusal.code,
                 e.refusal.message);
    }
  }
  expire_file_checks(now, out);
  expire_checkpoint_reads(now, out);
  expire_region_waiters(now, out);
  release_orphans(now, out);
  resend_pushes(now, out);
  prune(now, out);
  end_probations(now, out);
  schedule(now, out);
  // A shrink that rested or was skipped may be asked again.
  serve_waiting(out);
  request_shrinks(now, out);
}

std::optional<Clock::time_point> CoordinatorCore::next_deadline() const {
  std::optional<Clock::time_point> best;
  for (const auto& [ordinal, dev] : devices_) {
    if (auto l = dev.leases.next_deadline(); l && (!best || *l < *best)) best = l;
    if (auto r = dev.regions.next_deadline(); r && (!best || *r < *best)) best = r;
  }
  for (const auto& [token, p] : pending_submits_) {
    if (!best || p.deadline < *best) best = p.deadline;
  }
  for (const auto& [token, p] : pending_reads_) {
    if (!best || p.deadline < *best) best = p.deadline;
  }
  for (const auto& [name, agent] : agents_) {
    if (!agent.shrink) continue;
    auto due = agent.shrink->missed ? agent.shrink->deadline + opts_.shrink_timeout
                                    : agent.shrink->deadline;
    if (!best || due < *best) best = due;
  }
  return best;
}

void CoordinatorCore::shutdown(Effects& out) {
  for (const auto& [name, agent] : agents_) {
    proto::ShutdownT s;
    s.reason = "coordinator is shutting down";
    for (const auto& rid : agent.routing_ids) send(out, rid, 0, proto::ShutdownT(s));
  }
}

}  // namespace leasehold
