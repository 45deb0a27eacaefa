#include "coordinator/occupancy_policy.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "shared/units.h"

namespace leasehold {

OccupancyPolicy::OccupancyPolicy(OccupancyOptions options) : opt_(options) {
  if (!(opt_.low_watermark > 0 && opt_.low_watermark <= opt_.high_watermark &&
        opt_.high_watermark <= 1)) {
    throw std::invalid_argument("watermarks must satisfy 0 < low_watermark <= high_watermark <= 1");
  }
}

uint64_t OccupancyPolicy::low_bytes(const PoolView& pool) const {
  return static_cast<uint64_t>(
      std::floor(opt_.low_watermark * static_cast<double>(pool.pool_size)));
}

uint64_t OccupancyPolicy::high_bytes(const PoolView& pool) const {
  return static_cast<uint64_t>(
      std::floor(opt_.high_watermark * static_cast<double>(pool.pool_size)));
}

Pick OccupancyPolicy::pick_job(const AgentRecord&, std::span<JobRecord* const> queued,
                               const PoolView& pool) {
  // Strictly in queue order: letting smaller jobs past a large one would
  // starve it whenever small jobs keep coming.
  JobRecord* job = queued.front();
  const uint64_t committed = pool.used + pool.reserved();
  const uint64_t free = pool.pool_size > committed ? pool.pool_size - committed : 0;
  // What running jobs of this priority or lower hold past their shares
  // could be had back; a higher-priority job's could not.
  // Idle cache regions go too (least recently used first) once its leases
  // wait for their memory.
  const uint64_t reclaimable = pool.reclaimable(job->priority) + pool.evictable;
  const uint64_t need = job->guaranteed_bytes;
  if (need <= free + reclaimable) return Pick{job, ""};
  return Pick{nullptr, "waiting for " + format_bytes(need - free - reclaimable) + "; " +
                           format_bytes(free) + " free, " + format_bytes(reclaimable) +
                           " reclaimable (guaranteed share " + format_bytes(need) + ")"};
}

bool OccupancyPolicy::may_cache(uint64_t bytes, const PoolView& pool) {
  // Like speculative growth: a cache must not take memory a running job is
  // guaranteed, nor push the pool to where someone would be asked to shrink.
  return pool.used + pool.reserved() + bytes <= low_bytes(pool);
}

bool OccupancyPolicy::may_grant(const PendingRequest& request, const PoolView& pool) {
  if (pool.opportunistic(request)) {
    // Growth past the guaranteed share: reservations included, so a job
    // never grows into memory a running job is guaranteed, and never while
    // others' guaranteed requests wait. Growth the job could do without (it
    // would spill instead) stays below the low watermark and waits while
    // anyone is shrinking; growth it needs (nothing left to spill) may go up
    // to the high one, the only one that makes anyone shrink: refusing it
    // would fail the job with the memory free.
    bool others_wait =
        std::any_of(pool.waiting.begin(), pool.waiting.end(), [&](const PendingRequest& w) {
          return !pool.opportunistic(w) && w.owner != request.owner;
        });
    if (others_wait || (!request.needed && pool.shrink_pending() != 0)) return false;
    return growth_future(request, pool) <= (request.needed ? high_bytes(pool) : low_bytes(pool));
  }
  // Within a guaranteed share, or an agent without a job: granted while the
  // pool stays below the high watermark; above it, first the memory held
  // past guaranteed shares comes back (shrinks() asks for it).
  if (pool.used + request.size <= high_bytes(pool)) return true;
  return pool.reclaimable() == 0 && pool.shrink_pending() == 0;
}

uint64_t OccupancyPolicy::growth_future(const PendingRequest& request, const PoolView& pool) {
  const AgentShare* a = pool.find(request.owner);
  const uint64_t within = a && a->guaranteed > a->leased ? a->guaranteed - a->leased : 0;
  return pool.used + pool.reserved() - within + request.size;
}

std::vector<ShrinkOrder> OccupancyPolicy::orders(const PoolView& pool, uint64_t need,
                                                 const PendingRequest* needy,
                                                 const std::string& why) {
  const uint64_t pending = pool.shrink_pending();
  if (need <= pending) return {};
  need -= pending;
  const AgentShare* requester = needy ? pool.find(needy->owner) : nullptr;
  std::vector<const AgentShare*> candidates;
  for (const auto& a : pool.agents) {
    if (!a.shrinkable || a.over() == 0) continue;
    // A need takes growth back only from others, of its priority or lower.
    // An agent that is itself waiting for a lease is asked all the same: it
    // cannot answer before it has its lease, but if the memory never comes
    // it is skipped and then dropped like a silent agent, its job requeued
    // from its checkpoint, which is what lets the others go on (seen: a
    // job blocked in a needed lease that was never asked kept a waiting
    // guaranteed request from ever being served).
    if (needy && (LeaseOwner::agent(a.name) == needy->owner ||
                  (requester && a.priority > requester->priority))) {
      continue;
    }
    candidates.push_back(&a);
  }
  // Lowest priority first, then the most over its share.
  std::sort(candidates.begin(), candidates.end(), [](const AgentShare* x, const AgentShare* y) {
    if (x->priority != y->priority) return x->priority < y->priority;
    if (x->over() != y->over()) return x->over() > y->over();
    return x->name < y->name;
  });
  std::vector<ShrinkOrder> out;
  for (const AgentShare* a : candidates) {
    if (need == 0) break;
    uint64_t bytes = std::min(need, a->over());
    out.push_back(ShrinkOrder{a->name, bytes, why});
    need -= bytes;
  }
  return out;
}

std::vector<ShrinkOrder> OccupancyPolicy::shrinks(const PoolView& pool) {
  // What waiting guaranteed requests need above the high watermark, or,
  // when the free memory is in pieces too small for them, their size
  // (given-back leases merge with free neighbours), less what is being
  // released already. With none waiting, what brings the pool back to the
  // high watermark (guaranteed grants may have gone past it).
  uint64_t wanted = pool.used, unfit = 0;
  size_t waiting = 0;
  for (const auto& w : pool.waiting) {
    if (!pool.opportunistic(w)) {
      wanted += w.size;
      if (w.size > pool.largest_free) unfit += w.size;
      ++waiting;
    }
  }
  const uint64_t high = high_bytes(pool);
  const std::string occupancy =
      "occupancy " + std::to_string(static_cast<int>(pool.occupancy() * 100)) + "% with ";
  auto watermark = [&](uint64_t unfit_bytes) {
    return " (high watermark " + std::to_string(static_cast<int>(opt_.high_watermark * 100)) + "%" +
           (unfit_bytes ? ", largest free block " + format_bytes(pool.largest_free)
                        : std::string()) +
           ")";
  };
  if (waiting == 0) {
    // Growth that is needed (its job has nothing left to spill) may have
    // others' growth back: they can spill, it cannot. In queue order, the
    // first that someone can be asked for.
    for (const auto& w : pool.waiting) {
      if (!w.needed || !pool.opportunistic(w)) continue;
      const uint64_t future = growth_future(w, pool);
      const uint64_t w_unfit = w.size > pool.largest_free ? w.size : 0;
      auto out = orders(pool, std::max(future > high ? future - high : 0, w_unfit), &w,
                        occupancy + w.owner.describe() + " needing " + format_bytes(w.size) +
                            " it cannot spill" + watermark(w_unfit));
      if (!out.empty()) return out;
    }
  }
  const uint64_t need = std::max(wanted > high ? wanted - high : 0, unfit);
  return orders(pool, need, nullptr,
                occupancy + std::to_string(waiting) + " lease requests waiting" + watermark(unfit));
}

}  // namespace leasehold
