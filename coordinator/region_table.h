// Shared cache regions: named ranges of the pool that outlive the jobs that
// fill them (a decoded dataset, a model's parameters), reference-counted by
// the agents attached to them and kept as a cache after the last detach.
// Pure bookkeeping: a region's memory is a lease in its device's LeaseTable
// owned by LeaseOwner::region(name); the core (core_regions.cpp) places,
// evicts and frees
// it and talks to the agents. The rules are in coordinator/regions.md.
//
// Thread safety: none; the coordinator's core owns it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coordinator/lease_table.h"
#include "shared/region_names.h"

namespace leasehold {

enum class RegionState { Filling, Ready, Evicted };
const char* region_state_name(RegionState s);

struct RegionRecord {
  std::string name;
  int device = 0;  // whose pool it is in (each device has a table of its own)
  RegionState state = RegionState::Filling;
  uint64_t size = 0;      // bytes asked for (the lease is aligned up)
  uint64_t lease_id = 0;  // its memory while Filling or Ready; 0 when evicted
  uint64_t offset = 0;
  uint64_t lease_bytes = 0;
  std::string filler;                        // the agent writing it (Filling)
  std::map<std::string, uint32_t> attached;  // agent -> attachments
  Clock::time_point last_used{};             // least recently used goes first
  uint64_t last_used_ms = 0;                 // the same, as Unix ms
  uint64_t hits = 0, misses = 0;
  uint32_t evictions = 0;
  // A program job's session attached it since its memory was leased: its
  // chunks get new memory before anyone else has them (core_renewals.cpp).
  bool exposed = false;

  uint32_t refcount() const;
  bool resident() const { return state != RegionState::Evicted; }
  // Ready and nobody attached: a cache the policy may evict.
  bool evictable() const { return state == RegionState::Ready && attached.empty(); }
};

// An attach that waits while another agent fills the region.
struct RegionWaiter {
  std::string agent;
  std::string name;
  uint64_t size = 0;  // 0: any
  bool create = false;
  ReplyTo reply_to;
  Clock::time_point deadline;
};

class RegionTable {
 public:
  // The regions of device `device`'s pool.
  explicit RegionTable(int device = 0) : device_(device) {}
  RegionRecord* find(std::string_view name);
  const RegionRecord* find(std::string_view name) const;
  // A new record (Filling, no memory yet) or the evicted one of that name.
  RegionRecord& upsert(const std::string& name);
  void erase(std::string_view name);
  const std::map<std::string, RegionRecord, std::less<>>& all() const { return regions_; }
  std::map<std::string, RegionRecord, std::less<>>& all() { return regions_; }

  // The evictable region used least recently, other than `except`; null if none.
  RegionRecord* least_recently_used(std::string_view except = {});
  // Bytes of evictable regions (their leases).
  uint64_t evictable_bytes() const;
  // Keeps at most `keep` evicted records (the most recently used).
  void forget_evicted(size_t keep);

  std::deque<RegionWaiter>& waiters() { return waiters_; }
  const std::deque<RegionWaiter>& waiters() const { return waiters_; }
  // Removes and returns the waiters whose deadline is at or before `now`.
  std::vector<RegionWaiter> expire(Clock::time_point now);
  std::optional<Clock::time_point> next_deadline() const;

  // Totals since the coordinator started.
  uint64_t hits = 0, misses = 0, evictions = 0;

 private:
  int device_;
  std::map<std::string, RegionRecord, std::less<>> regions_;
  std::deque<RegionWaiter> waiters_;
};

}  // namespace leasehold
