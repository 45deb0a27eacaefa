#include "agent/engine/memory_plan.h"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>
#include <utility>

#include "shared/units.h"

namespace leasehold::engine {

namespace {

bool overlap_in_time(const PlannedBlock& a, const PlannedBlock& b) {
  return a.first < b.last && b.first < a.last;
}

}  // namespace

MemoryPlan plan_memory(const std::vector<PlannedBlock>& blocks, uint64_t alignment) {
  if (alignment == 0 || (alignment & (alignment - 1)) != 0) {
    throw std::invalid_argument("plan_memory: alignment " + std::to_string(alignment) +
                                " is not a power of two");
  }
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].last < blocks[i].first) {
      throw std::invalid_argument("plan_memory: block " + std::to_string(i) + " ends (event " +
                                  std::to_string(blocks[i].last) + ") before it starts (event " +
                                  std::to_string(blocks[i].first) + ")");
    }
  }
  MemoryPlan plan;
  plan.offsets.assign(blocks.size(), 0);
  std::vector<uint64_t> size(blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) size[i] = align_up(blocks[i].bytes, alignment);

  // Largest first; among equals the earliest, so the order (and the plan)
  // depends on the blocks alone.
  std::vector<size_t> order(blocks.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return size[a] > size[b]; });
  std::vector<size_t> placed;
  placed.reserve(blocks.size());
  std::vector<std::pair<uint64_t, uint64_t>> busy;  // [offset, end) of placed blocks live meanwhile
  for (size_t i : order) {
    busy.clear();
    for (size_t j : placed) {
      if (overlap_in_time(blocks[i], blocks[j])) busy.emplace_back(plan.offsets[j], plan.offsets[j] + size[j]);
    }
    std::sort(busy.begin(), busy.end());
    // The smallest gap between them that holds the block, else above them.
    uint64_t best = UINT64_MAX, best_gap = UINT64_MAX, top = 0;
    for (const auto& [begin, end] : busy) {
      if (begin >= top && begin - top >= size[i] && begin - top < best_gap) {
        best = top;
        best_gap = begin - top;
      }
      top = std::max(top, end);
    }
    plan.offsets[i] = best != UINT64_MAX ? best : top;
    plan.arena_bytes = std::max(plan.arena_bytes, plan.offsets[i] + size[i]);
    placed.push_back(i);
  }

  // The most bytes live at once: over the events in order, frees before
  // allocations at the same event (a block is live up to its last event).
  std::vector<std::pair<uint64_t, int64_t>> events;
  events.reserve(2 * blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    if (blocks[i].first == blocks[i].last) continue;
    events.emplace_back(blocks[i].first, static_cast<int64_t>(size[i]));
    events.emplace_back(blocks[i].last, -static_cast<int64_t>(size[i]));
  }
  std::sort(events.begin(), events.end());
  int64_t live = 0;
  for (const auto& [at, delta] : events) {
    live += delta;
    plan.peak_live_bytes = std::max(plan.peak_live_bytes, static_cast<uint64_t>(live));
  }
  return plan;
}

}  // namespace leasehold::engine
