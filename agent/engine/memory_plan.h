// Lays out allocations whose sizes and lifetimes are known in advance in
// one arena, the way an ahead-of-time planner does for a graph's tensors
// (TFLite's and XLA's "greedy by size"): largest first, each in the
// smallest gap, among the blocks already placed that are live at the same
// time, that holds it, else above them all. The arena it asks for is at
// least the most bytes live at once and, for the tensors of a training
// step, close to it, where a pool that reuses only blocks of the same size
// holds the most of each size live at once, summed over sizes.
#pragma once

#include <cstdint>
#include <vector>

namespace leasehold::engine {

// One allocation: `bytes`, live from event `first` up to (not including)
// event `last` (events number the allocations and frees in their order).
struct PlannedBlock {
  uint64_t bytes = 0;
  uint64_t first = 0, last = 0;
};

struct MemoryPlan {
  std::vector<uint64_t> offsets;  // each block's place in the arena, in input order
  uint64_t arena_bytes = 0;       // the arena the offsets need
  uint64_t peak_live_bytes = 0;   // the most bytes live at once (no plan needs less)
};

// Offsets are multiples of `alignment` (a power of two) and each block is
// rounded up to one. Throws std::invalid_argument for a block that ends
// before it starts or a bad alignment.
MemoryPlan plan_memory(const std::vector<PlannedBlock>& blocks, uint64_t alignment);

}  // namespace leasehold::engine
