#include "coordinator/scheduler.h"

#include <algorithm>

namespace leasehold {

const AgentShare* PoolView::find(const std::string& name) const {
  auto it = std::lower_bound(agents.begin(), agents.end(), name,
                             [](const AgentShare& a, const std::string& n) { return a.name < n; });
  return it != agents.end() && it->name == name ? &*it : nullptr;
}

uint64_t PoolView::reserved() const {
  uint64_t total = 0;
  for (const auto& a : agents) total += a.reserved();
  for (const auto& r : waiting) {
    const AgentShare* a = find(r.owner);
    if (!a || !a->managed()) total += r.size;
  }
  return total;
}

uint64_t PoolView::reclaimable(int priority) const {
  uint64_t total = 0;
  for (const auto& a : agents) {
    if (a.shrinkable && a.priority <= priority) total += a.over();
  }
  return total;
}

uint64_t PoolView::shrink_pending() const {
  uint64_t total = 0;
  for (const auto& a : agents) total += a.shrink_pending;
  return total;
}

bool PoolView::opportunistic(const PendingRequest& request) const {
  const AgentShare* a = find(request.owner);
  return a && a->managed() && a->leased + request.size > a->guaranteed;
}

double PoolView::occupancy() const {
  return pool_size ? static_cast<double>(used) / static_cast<double>(pool_size) : 0;
}

double PoolView::occupancy_future(uint64_t bytes) const {
  return pool_size ? static_cast<double>(used + reserved() + bytes) / static_cast<double>(pool_size)
                   : 0;
}

Pick FifoPolicy::pick_job(const AgentRecord&, std::span<JobRecord* const> queued, const PoolView&) {
  // Every agent maps the same pool, so any queued job suits any agent; the
  // core has already left out jobs whose device does not match the pool.
  return Pick{queued.empty() ? nullptr : queued.front(), ""};
}

bool FifoPolicy::may_grant(const PendingRequest&, const PoolView&) { return true; }

}  // namespace leasehold
