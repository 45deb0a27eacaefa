#include "coordinator/region_table.h"

#include <algorithm>

namespace leasehold {

const char* region_state_name(RegionState s) {
  switch (s) {
    case RegionState::Filling:
      return "filling";
    case RegionState::Ready:
      return "ready";
    case RegionState::Evicted:
      return "evicted";
  }
  return "?";
}

uint32_t RegionRecord::refcount() const {
  uint32_t n = 0;
  for (const auto& [agent, count] : attached) n += count;
  return n;
}

RegionRecord* RegionTable::find(std::string_view name) {
  auto it = regions_.find(name);
  return it == regions_.end() ? nullptr : &it->second;
}

const RegionRecord* RegionTable::find(std::string_view name) const {
  auto it = regions_.find(name);
  return it == regions_.end() ? nullptr : &it->second;
}

RegionRecord& RegionTable::upsert(const std::string& name) {
  RegionRecord& r = regions_[name];
  r.name = name;
  r.device = device_;
  return r;
}

void RegionTable::erase(std::string_view name) {
  if (auto it = regions_.find(name); it != regions_.end()) regions_.erase(it);
}

RegionRecord* RegionTable::least_recently_used(std::string_view except) {
  RegionRecord* best = nullptr;
  for (auto& [name, r] : regions_) {
    if (!r.evictable() || name == except) continue;
    if (!best || r.last_used < best->last_used) best = &r;
  }
  return best;
}

uint64_t RegionTable::evictable_bytes() const {
  uint64_t total = 0;
  for (const auto& [name, r] : regions_) total += r.evictable() ? r.lease_bytes : 0;
  return total;
}

void RegionTable::forget_evicted(size_t keep) {
  std::vector<const RegionRecord*> evicted;
  for (const auto& [name, r] : regions_) {
    if (r.state == RegionState::Evicted) evicted.push_back(&r);
  }
  if (evicted.size() <= keep) return;
  std::sort(evicted.begin(), evicted.end(), [](const RegionRecord* a, const RegionRecord* b) {
    return a->last_used < b->last_used;
  });
  std::vector<std::string> drop;
  for (size_t i = 0; i + keep < evicted.size(); ++i) drop.push_back(evicted[i]->name);
  for (const auto& name : drop) regions_.erase(name);
}

std::vector<RegionWaiter> RegionTable::expire(Clock::time_point now) {
  std::vector<RegionWaiter> out;
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (it->deadline <= now) {
      out.push_back(std::move(*it));
      it = waiters_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::optional<Clock::time_point> RegionTable::next_deadline() const {
  std::optional<Clock::time_point> best;
  for (const auto& w : waiters_) {
    if (!best || w.deadline < *best) best = w.deadline;
  }
  return best;
}

}  // namespace leasehold
