// The arena planner (memory_plan.h): no two blocks live at the same time
// share a byte, offsets keep their alignment, and the arena stays close to
// the most bytes live at once.
#include "agent/engine/memory_plan.h"

#include <gtest/gtest.h>

#include <random>
#include <stdexcept>

#include "shared/units.h"

namespace leasehold::engine {
namespace {

// Every pair live at the same time is apart in the arena.
void expect_valid(const std::vector<PlannedBlock>& blocks, const MemoryPlan& plan,
                  uint64_t alignment) {
  ASSERT_EQ(plan.offsets.size(), blocks.size());
  for (size_t i = 0; i < blocks.size(); ++i) {
    EXPECT_EQ(plan.offsets[i] % alignment, 0u) << i;
    const uint64_t end_i = plan.offsets[i] + align_up(blocks[i].bytes, alignment);
    EXPECT_LE(end_i, plan.arena_bytes) << i;
    for (size_t j = i + 1; j < blocks.size(); ++j) {
      const bool meanwhile = blocks[i].first < blocks[j].last && blocks[j].first < blocks[i].last;
      const uint64_t end_j = plan.offsets[j] + align_up(blocks[j].bytes, alignment);
      const bool apart = end_i <= plan.offsets[j] || end_j <= plan.offsets[i];
      ASSERT_TRUE(!meanwhile || apart) << "blocks " << i << " and " << j << " overlap";
    }
  }
  EXPECT_GE(plan.arena_bytes, plan.peak_live_bytes);
}

TEST(MemoryPlan, BlocksOneAfterAnotherShareOnePlace) {
  const std::vector<PlannedBlock> blocks{{1000, 0, 1}, {512, 2, 3}, {700, 4, 5}};
  const MemoryPlan plan = plan_memory(blocks, 512);
  expect_valid(blocks, plan, 512);
  EXPECT_EQ(plan.offsets, (std::vector<uint64_t>{0, 0, 0}));
  EXPECT_EQ(plan.arena_bytes, 1024u) << "the largest, rounded to the alignment";
  EXPECT_EQ(plan.peak_live_bytes, 1024u);
}

TEST(MemoryPlan, AGapLeftByAFreedBlockIsReusedBySmallerOnes) {
  // a [0, 2) and b [1, 4) meet; c [3, 5) fits where a was, beside b; d comes
  // after them all. Reusing only blocks of the same size would hold
  // 1024 + 512 + 2048 + 768.
  const std::vector<PlannedBlock> blocks{
      {1024, 0, 2}, {512, 1, 4}, {768, 3, 5}, {2048, 6, 9}};
  const MemoryPlan plan = plan_memory(blocks, 256);
  expect_valid(blocks, plan, 256);
  EXPECT_EQ(plan.peak_live_bytes, 2048u);
  EXPECT_EQ(plan.arena_bytes, 2048u);
}

TEST(MemoryPlan, ATrainingStepShapedTraceNeedsLittleMoreThanItsPeak) {
  // Forward keeps activations of a few sizes, backward frees them newest
  // first while gradients of other sizes come and stay, with short-lived
  // temporaries throughout.
  std::vector<PlannedBlock> blocks;
  uint64_t event = 0;
  std::mt19937_64 rng(7);
  const uint64_t sizes[] = {25 << 20, 12 << 20, 50 << 20, 37 << 20};
  std::vector<size_t> saved;
  for (int layer = 0; layer < 24; ++layer) {
    for (uint64_t s : sizes) {
      blocks.push_back({s + rng() % 4096, event++, 0});
      saved.push_back(blocks.size() - 1);
      blocks.push_back({s / 2, event, event + 2});  // a temporary
      event += 3;
    }
  }
  for (size_t k = saved.size(); k-- > 0;) {
    blocks.push_back({(3 << 20) + rng() % (1 << 20), event++, UINT64_MAX});  // a gradient
    blocks.push_back({blocks[saved[k]].bytes, event, event + 1});            // its input's
    event += 2;
    blocks[saved[k]].last = event++;
  }
  for (auto& b : blocks) b.last = std::min(b.last, event);
  const MemoryPlan plan = plan_memory(blocks, 512);
  expect_valid(blocks, plan, 512);
  EXPECT_LE(plan.arena_bytes, plan.peak_live_bytes * 11 / 10)
      << plan.arena_bytes << " for a peak of " << plan.peak_live_bytes;
}

TEST(MemoryPlan, RandomLifetimesNeverShareAByteWhileLive) {
  std::mt19937_64 rng(11);
  for (int round = 0; round < 20; ++round) {
    std::vector<PlannedBlock> blocks(200);
    for (auto& b : blocks) {
      b.bytes = 1 + rng() % 100000;
      b.first = rng() % 1000;
      b.last = b.first + rng() % 300;
    }
    const MemoryPlan plan = plan_memory(blocks, 256);
    expect_valid(blocks, plan, 256);
    if (HasFatalFailure()) return;
  }
}

TEST(MemoryPlan, BadInputIsNamed) {
  try {
    plan_memory({{64, 0, 1}, {64, 5, 3}}, 512);
    FAIL() << "a block that ends before it starts";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("block 1 ends (event 3) before it starts (event 5)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(plan_memory({{64, 0, 1}}, 384), std::invalid_argument);
  EXPECT_THROW(plan_memory({{64, 0, 1}}, 0), std::invalid_argument);
  const MemoryPlan none = plan_memory({}, 512);
  EXPECT_EQ(none.arena_bytes, 0u);
  EXPECT_TRUE(none.offsets.empty());
}

}  // namespace
}  // namespace leasehold::engine
