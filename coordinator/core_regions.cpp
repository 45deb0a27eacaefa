// The core's shared cache regions: attach (creating and filling, or waiting
// for the filler), ready, detach, listing, drop, eviction, and what happens
// when a filler goes away. The rules are in coordinator/regions.md.
#include <spdlog/spdlog.h>

#include <algorithm>

#include "coordinator/core.h"
#include "coordinator/replies.h"
#include "shared/printable.h"
#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold {
namespace {

// Evicted regions kept in listings (their counters tell an operator why jobs
// had to fill them again).
constexpr size_t kEvictedKept = 64;

std::unique_ptr<proto::RegionT> region_object(const RegionRecord& r) {
  auto o = std::make_unique<proto::RegionT>();
  o->name = r.name;
  o->offset = r.offset;
  o->size = r.size;
  o->state = r.state == RegionState::Filling ? proto::RegionState::Filling
             : r.state == RegionState::Ready ? proto::RegionState::Ready
                                             : proto::RegionState::Evicted;
  o->refcount = r.refcount();
  o->last_used_ms = r.last_used_ms;
  o->hits = r.hits;
  o->misses = r.misses;
  o->evictions = r.evictions;
  o->filler = r.filler;
  for (const auto& [agent, n] : r.attached) o->agents.push_back(agent);
  o->device = r.device;
  return o;
}

void touch(RegionRecord& r, Now now) {
  r.last_used = now.steady;
  r.last_used_ms = now.unix_ms;
}

std::string agent_list(const RegionRecord& r) {
  std::string s;
  for (const auto& [agent, n] : r.attached) {
    s += (s.empty() ? "'" : ", '") + agent + "'" + (n > 1 ? " (" + std::to_string(n) + ")" : "");
  }
  return s;
}

}  // namespace

void CoordinatorCore::on_attach_region(const std::string& rid, AgentRecord& agent,
                                       const proto::Envelope& env, Now now, Effects& out) {
  const auto* a = env.body_as_AttachRegion();
  const uint64_t req = env.header()->request_id();
  const std::string name(str(a->name()));
  const uint64_t size = a->size();
  if (!valid_region_name(name)) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "region name '" + printable(name, 128) +
                          "' is invalid: use 1-128 letters, digits, '.', '_', '-', ':' or '/' "
                          "(not first)");
  }
  if (a->create() && size == 0) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "region '" + name + "': a region to create needs a positive size");
  }
  if (a->replace() && !a->create()) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "region '" + name + "': replace needs create (the new contents' size)");
  }
  DeviceState& dev = device_of(agent);
  if (size > dev.pool.size) {
    return send_error(out, rid, req, ErrorCode::TooLarge,
                      "region '" + name + "' of " + format_bytes(size) + " can never fit: the " +
                          dev.label() + " pool holds " + format_bytes(dev.pool.size));
  }
  const int64_t wait_ms = a->wait_ms() < 0 ? opts_.lease_wait_timeout.count() : a->wait_ms();
  const ReplyTo to{rid, req};
  RegionRecord* rec = dev.regions.find(name);
  if (rec && rec->resident()) {
    if (rec->filler == agent.name) {
      return send_error(out, rid, req, ErrorCode::RegionBusy,
                        "agent '" + agent.name + "' is filling region '" + name + "' itself");
    }
    if (!a->replace()) {
      if (size != 0 && size != rec->size) {
        return send_error(out, rid, req, ErrorCode::InvalidArgument,
                          "region '" + name + "' holds " + std::to_string(rec->size) +
                              " bytes, not the " + std::to_string(size) + " asked for");
      }
      if (rec->state == RegionState::Ready) {
        ++rec->hits;
        ++dev.regions.hits;
        return grant_region(*rec, agent.name, to, false, now, out);
      }
      if (wait_ms == 0) {
        return send_error(out, rid, req, ErrorCode::RegionBusy,
                          "region '" + name + "' is being filled by agent '" + rec->filler + "'");
      }
      if (auto no = wait_refusal(agent.name, wait_ms)) {
        return send_error(out, rid, req, no->code, "region '" + name + "': " + no->message);
      }
      dev.regions.waiters().push_back(
          RegionWaiter{agent.name, name, size, a->create(), to,
                       now.steady + std::chrono::milliseconds(wait_ms)});
      spdlog::info("agent '{}' waits up to {} ms for region '{}' (agent '{}' fills it)", agent.name,
                   wait_ms, name, rec->filler);
      return;
    }
    if (rec->state == RegionState::Filling || !rec->attached.empty()) {
      return send_error(
          out, rid, req, ErrorCode::RegionBusy,
          "region '" + name + "' cannot be replaced: " +
              (rec->state == RegionState::Filling ? "agent '" + rec->filler + "' is filling it"
                                                  : "attached by " + agent_list(*rec)));
    }
    // The old contents go only once the new ones surely have a place.
    const uint64_t bytes = align_up(size, dev.pool.alignment);
    if (std::string no = cache_refusal(dev, bytes, rec->lease_bytes);
        !no.empty() || bytes > dev.leases.allocator().free_bytes() + rec->lease_bytes +
                                   dev.regions.evictable_bytes()) {
      return send_error(out, rid, req, ErrorCode::NoSpace,
                        "region '" + name + "' of " + format_bytes(size) +
                            " cannot replace the one there: " + (no.empty() ? "no room" : no));
    }
    spdlog::info("region '{}' ({}) replaced by agent '{}'", name, format_bytes(rec->size),
                 agent.name);
    free_region_memory(*rec);
    rec->state = RegionState::Evicted;
  }
  if (!a->create()) {
    return send_error(
        out, rid, req, ErrorCode::NoSuchRegion,
        rec ? "region '" + name + "' was evicted (its memory was needed); fill it again"
            : "no region '" + name + "'");
  }
  const bool existed = rec != nullptr;
  RegionRecord& r = dev.regions.upsert(name);
  if (std::string why = place_region(dev, r, size, now); !why.empty()) {
    if (!existed) dev.regions.erase(name);
    spdlog::info("region '{}' of {} for agent '{}' not placed: {}", name, format_bytes(size),
                 agent.name, why);
    return send_error(out, rid, req, ErrorCode::NoSpace,
                      "no room for region '" + name + "' of " + format_bytes(size) + ": " + why);
  }
  ++r.misses;
  ++dev.regions.misses;
  r.filler = agent.name;
  spdlog::info("region '{}' ({}) placed at offset {}; agent '{}' fills it", name,
               format_bytes(size), r.offset, agent.name);
  grant_region(r, agent.name, to, true, now, out);
}

std::string CoordinatorCore::cache_refusal(const DeviceState& dev, uint64_t bytes,
                                           uint64_t also_free) const {
  // A cache never jumps ahead of leases that wait for memory.
  if (size_t waiting = dev.leases.waiting(); waiting > 0) {
    return std::to_string(waiting) + " lease request(s) wait for memory";
  }
  if (bytes > dev.pool.size) {
    return "it is larger than the pool (" + format_bytes(dev.pool.size) + ")";
  }
  // Even with every idle region gone (and `also_free` given back):
  const uint64_t idle = dev.regions.evictable_bytes() + also_free;
  PoolView best = pool_view(dev);
  best.used -= std::min(best.used, idle);
  if (!policy_->may_cache(bytes, best)) {
    return "occupancy with the running jobs' reservations would reach " +
           std::to_string(static_cast<int>(best.occupancy_future(bytes) * 100)) +
           "%, more than a cache may take (" + policy_->name() + " policy, low watermark " +
           std::to_string(static_cast<int>(policy_->low_watermark() * 100)) + "%)";
  }
  const auto& alloc = dev.leases.allocator();
  if (bytes > alloc.free_bytes() + idle) {
    return "free " + format_bytes(alloc.free_bytes()) + ", idle regions " + format_bytes(idle);
  }
  return "";
}

std::string CoordinatorCore::place_region(DeviceState& dev, RegionRecord& rec, uint64_t size,
                                          Now now) {
  const uint64_t bytes = align_up(size, dev.pool.alignment);
  // Nothing is evicted for a region that could not be placed anyway.
  if (std::string no = cache_refusal(dev, bytes); !no.empty()) return no;
  while (true) {
    const PoolView view = pool_view(dev);
    const bool allowed = policy_->may_cache(bytes, view);
    if (allowed) {
      PendingRequest p{LeaseOwner::region(rec.name),
                       size,
                       PoolAllocator::End::High,
                       now.steady,
                       {},
                       now.steady,
                       false};
      auto outcome = dev.leases.request(p, /*may_wait=*/false);
      if (const auto* lease = std::get_if<LeaseRecord>(&outcome)) {
        rec.state = RegionState::Filling;
        rec.size = size;
        rec.lease_id = lease->id;
        rec.offset = lease->offset;
        rec.lease_bytes = lease->size;
        touch(rec, now);
        return "";
      }
    }
    RegionRecord* victim = dev.regions.least_recently_used(rec.name);
    if (!victim) {
      const auto& alloc = dev.leases.allocator();
      if (!allowed) {
        return "occupancy with the running jobs' reservations would reach " +
               std::to_string(static_cast<int>(view.occupancy_future(bytes) * 100)) +
               "%, more than a cache may take (" + policy_->name() + " policy, low watermark " +
               std::to_string(static_cast<int>(policy_->low_watermark() * 100)) + "%)";
      }
      return "free " + format_bytes(alloc.free_bytes()) + ", largest free block " +
             format_bytes(alloc.largest_free());
    }
    evict_region(*victim, "to make room for region '" + rec.name + "'", now);
  }
}

void CoordinatorCore::grant_region(RegionRecord& rec, const std::string& agent, const ReplyTo& to,
                                   bool fill, Now now, Effects& out) {
  ++rec.attached[agent];
  if (auto a = agents_.find(agent); a != agents_.end() && a->second.program_job != 0) {
    rec.exposed = true;
  }
  touch(rec, now);
  proto::RegionGrantT g;
  g.region = region_object(rec);
  g.fill = fill;
  send(out, to.routing_id, to.request_id, std::move(g));
}

void CoordinatorCore::free_region_memory(RegionRecord& rec, const std::string& to_agent) {
  if (rec.lease_id == 0) return;
  DeviceState& dev = devices_.at(rec.device);
  if (!to_agent.empty()) {
    dev.leases.reassign(rec.lease_id, LeaseOwner::agent(to_agent));
  } else {
    (void)give_back(dev, LeaseOwner::region(rec.name), rec.exposed, "region " + rec.name,
                    rec.lease_id);
  }
  rec.exposed = false;
  rec.lease_id = 0;
  rec.offset = 0;
  rec.lease_bytes = 0;
}

void CoordinatorCore::evict_region(RegionRecord& rec, const std::string& why, Now now) {
  spdlog::info("evicted region '{}' ({}, idle for {} ms): {}", rec.name, format_bytes(rec.size),
               now.unix_ms > rec.last_used_ms ? now.unix_ms - rec.last_used_ms : 0, why);
  free_region_memory(rec);
  rec.state = RegionState::Evicted;
  ++rec.evictions;
  ++devices_.at(rec.device).regions.evictions;
}

void CoordinatorCore::discard_region(DeviceState& dev, const std::string& name,
                                     const std::string& why, Now now, Effects& out) {
  RegionRecord* rec = dev.regions.find(name);
  if (!rec) return;
  spdlog::warn("region '{}' discarded before it was ready: {}", name, why);
  free_region_memory(*rec);
  rec->state = RegionState::Evicted;
  rec->filler.clear();
  rec->attached.clear();  // while filling, only the filler was attached
  // Those waiting for it: the first that may create it fills it now, the
  // others wait for that one; without such a one they all learn why.
  std::vector<RegionWaiter> mine;
  auto& waiters = dev.regions.waiters();
  for (auto it = waiters.begin(); it != waiters.end();) {
    if (it->name == name) {
      mine.push_back(std::move(*it));
      it = waiters.erase(it);
    } else {
      ++it;
    }
  }
  bool refilling = false;
  for (auto& w : mine) {
    if (refilling) {
      waiters.push_back(std::move(w));
      continue;
    }
    if (!w.create) {
      send_error(out, w.reply_to.routing_id, w.reply_to.request_id, ErrorCode::NoSuchRegion,
                 "region '" + name + "' was discarded before it was ready (" + why + ")");
      continue;
    }
    if (std::string no = place_region(dev, *rec, rec->size, now); !no.empty()) {
      send_error(out, w.reply_to.routing_id, w.reply_to.request_id, ErrorCode::NoSpace,
                 "region '" + name + "' was discarded (" + why +
                     ") and there is no room to fill "
                     "it again: " +
                     no);
      continue;
    }
    ++rec->misses;
    ++dev.regions.misses;
    rec->filler = w.agent;
    spdlog::info("agent '{}' fills region '{}' again", w.agent, name);
    grant_region(*rec, w.agent, w.reply_to, true, now, out);
    refilling = true;
  }
}

std::vector<std::string> CoordinatorCore::drop_region_users(DeviceState& dev,
                                                            const std::string& agent, Now now) {
  std::erase_if(dev.regions.waiters(), [&](const RegionWaiter& w) { return w.agent == agent; });
  std::vector<std::string> discarded;
  for (auto& [name, r] : dev.regions.all()) {
    if (r.attached.erase(agent)) touch(r, now);
    if (r.state == RegionState::Filling && r.filler == agent) {
      free_region_memory(r, agent);
      r.filler.clear();
      discarded.push_back(name);
    }
  }
  return discarded;
}

void CoordinatorCore::expire_region_waiters(Now now, Effects& out) {
  for (auto& [ordinal, dev] : devices_) {
    for (auto& w : dev.regions.expire(now.steady)) {
      const RegionRecord* rec = dev.regions.find(w.name);
      send_error(
          out, w.reply_to.routing_id, w.reply_to.request_id, ErrorCode::Timeout,
          "region '" + w.name + "' was not ready before the attach's deadline" +
              (rec && !rec->filler.empty() ? " (agent '" + rec->filler + "' fills it)" : ""));
    }
    dev.regions.forget_evicted(kEvictedKept);
  }
}

bool CoordinatorCore::eviction_could_serve(const DeviceState& dev) const {
  const PoolView view = pool_view(dev);
  const uint64_t room = dev.leases.allocator().free_bytes() + view.evictable;
  for (const auto& w : view.waiting) {
    if ((!view.opportunistic(w) || w.needed) && w.size <= room) return true;
  }
  return false;
}

void CoordinatorCore::evict_for_admission(DeviceState& dev, const JobRecord& job, Now now) {
  const PoolView view = pool_view(dev);
  const uint64_t committed = view.used + view.reserved();
  const uint64_t free = view.pool_size > committed ? view.pool_size - committed : 0;
  const uint64_t have = free + view.reclaimable(job.priority);
  uint64_t shortfall = job.guaranteed_bytes > have ? job.guaranteed_bytes - have : 0;
  while (shortfall > 0) {
    RegionRecord* idle = dev.regions.least_recently_used();
    if (!idle) return;
    shortfall -= std::min(shortfall, idle->lease_bytes);
    evict_region(*idle, "job " + std::to_string(job.id) + " was admitted counting on its memory",
                 now);
  }
}

void CoordinatorCore::on_region_ready(const std::string& rid, AgentRecord& agent,
                                      const proto::Envelope& env, Now now, Effects& out) {
  const uint64_t req = env.header()->request_id();
  const std::string name(str(env.body_as_RegionReady()->name()));
  DeviceState& dev = device_of(agent);
  RegionRecord* rec = dev.regions.find(name);
  if (!rec || !rec->resident()) {
    return send_error(out, rid, req, ErrorCode::NoSuchRegion, "no region '" + name + "'");
  }
  if (rec->state != RegionState::Filling || rec->filler != agent.name) {
    return send_error(out, rid, req, ErrorCode::NotOwner,
                      "region '" + name + "' is not being filled by agent '" + agent.name + "'" +
                          (rec->state == RegionState::Ready ? " (it is ready)" : ""));
  }
  rec->state = RegionState::Ready;
  rec->filler.clear();
  touch(*rec, now);
  spdlog::info("region '{}' ({}) ready, filled by agent '{}'", name, format_bytes(rec->size),
               agent.name);
  send_ack(out, rid, req);
  auto& waiters = dev.regions.waiters();
  for (auto it = waiters.begin(); it != waiters.end();) {
    if (it->name != name) {
      ++it;
      continue;
    }
    ++rec->hits;
    ++dev.regions.hits;
    grant_region(*rec, it->agent, it->reply_to, false, now, out);
    it = waiters.erase(it);
  }
}

void CoordinatorCore::on_detach_region(const std::string& rid, AgentRecord& agent,
                                       const proto::Envelope& env, Now now, Effects& out) {
  const uint64_t req = env.header()->request_id();
  const std::string name(str(env.body_as_DetachRegion()->name()));
  DeviceState& dev = device_of(agent);
  RegionRecord* rec = dev.regions.find(name);
  if (!rec || !rec->attached.count(agent.name)) {
    return send_error(out, rid, req, ErrorCode::NoSuchRegion,
                      "agent '" + agent.name + "' is not attached to region '" + name + "'");
  }
  if (auto it = rec->attached.find(agent.name); --it->second == 0) rec->attached.erase(it);
  touch(*rec, now);
  send_ack(out, rid, req);
  if (rec->state == RegionState::Filling && rec->filler == agent.name) {
    discard_region(dev, name, "agent '" + agent.name + "' detached before marking it ready", now,
                   out);
  }
  // Idle now: it may be evicted for a waiting request or an admission.
  serve_waiting(dev, out);
  schedule(now, out);
}

void CoordinatorCore::on_list_regions(const std::string& rid, uint64_t req, Effects& out) {
  proto::RegionListT list;
  for (const auto& [ordinal, dev] : devices_) {
    for (const auto& [name, r] : dev.regions.all()) list.regions.push_back(region_object(r));
    list.hits += dev.regions.hits;
    list.misses += dev.regions.misses;
    list.evictions += dev.regions.evictions;
  }
  send(out, rid, req, std::move(list));
}

void CoordinatorCore::on_drop_region(const std::string& rid, const proto::Envelope& env, Now now,
                                     Effects& out, const Peer& peer) {
  const uint64_t req = env.header()->request_id();
  if (auto refusal = opts_.access.check(Role::Client, peer)) {
    return send_error(out, rid, req, ErrorCode::PermissionDenied, *refusal);
  }
  const auto* drop = env.body_as_DropRegion();
  const std::string name(str(drop->name()));
  // The regions of that name (on the device asked for, or on every one):
  // each must be free to go, or none goes.
  std::vector<std::pair<DeviceState*, RegionRecord*>> found;
  for (auto& [ordinal, dev] : devices_) {
    if (drop->device() >= 0 && drop->device() != ordinal) continue;
    if (RegionRecord* rec = dev.regions.find(name)) found.emplace_back(&dev, rec);
  }
  if (found.empty()) {
    return send_error(
        out, rid, req, ErrorCode::NoSuchRegion,
        "no region '" + name + "'" +
            (drop->device() >= 0 ? " on device " + std::to_string(drop->device()) : ""));
  }
  for (const auto& [dev, rec] : found) {
    if (rec->state == RegionState::Filling) {
      return send_error(out, rid, req, ErrorCode::RegionBusy,
                        "region '" + name + "' on " + dev->label() + " is being filled by agent '" +
                            rec->filler + "'");
    }
    if (!rec->attached.empty()) {
      return send_error(out, rid, req, ErrorCode::RegionBusy,
                        "region '" + name + "' on " + dev->label() + " is attached by " +
                            agent_list(*rec) + "; drop it once they detach (their jobs end)");
    }
  }
  for (const auto& [dev, rec] : found) {
    spdlog::info("region '{}' ({}) on {} dropped on request", name, format_bytes(rec->size),
                 dev->label());
    free_region_memory(*rec);
    dev->regions.erase(name);
    serve_waiting(*dev, out);
  }
  send_ack(out, rid, req);
  schedule(now, out);
}

}  // namespace leasehold
