// The plug-in's growth rules (torch_plugin/growth_rule.h) against a fake
// clock: what a PyTorch job's lease requests ask of the coordinator.
#include "torch_plugin/growth_rule.h"

#include <gtest/gtest.h>

#include <cstdint>

namespace {

using leasehold::torch_plugin::GrowthRule;
using namespace std::chrono_literals;

constexpr uint64_t kMiB = 1ull << 20;
const GrowthRule::Clock::time_point kT0{};

TEST(GrowthRule, WithinTheShareALeaseMayWaitAndIsNotNeeded) {
  GrowthRule rule(1024 * kMiB);
  auto a = rule.ask(512 * kMiB, true, 512 * kMiB, false, false, kT0);
  EXPECT_FALSE(a.growth);
  EXPECT_FALSE(a.needed);
  EXPECT_FALSE(a.held_back);
  EXPECT_EQ(a.wait_ms, -1);
}

TEST(GrowthRule, PastTheShareGrowthIsAskedWithoutWaiting) {
  GrowthRule rule(1024 * kMiB);
  auto a = rule.ask(1000 * kMiB, true, 32 * kMiB, false, false, kT0);
  EXPECT_TRUE(a.growth);
  EXPECT_FALSE(a.needed);
  EXPECT_EQ(a.wait_ms, 0);
  // Already past it, and sizes near the top of the range: no overflow.
  EXPECT_TRUE(rule.ask(2048 * kMiB, true, 2 * kMiB, false, false, kT0).growth);
  EXPECT_TRUE(rule.ask(UINT64_MAX - kMiB, true, 2 * kMiB, false, false, kT0).growth);
  EXPECT_FALSE(rule.ask(0, true, 1024 * kMiB, false, false, kT0).growth);
}

TEST(GrowthRule, ARefusalForSpaceHoldsGrowthBackForTheBackoffOnly) {
  GrowthRule rule(1024 * kMiB);
  auto a = rule.ask(1024 * kMiB, true, 64 * kMiB, false, false, kT0);
  rule.refused_for_space(a, kT0);
  auto b = rule.ask(1024 * kMiB, true, 64 * kMiB, false, false, kT0 + 999ms);
  EXPECT_TRUE(b.held_back);
  // A held-back answer does not extend the backoff.
  rule.refused_for_space(b, kT0 + 999ms);
  EXPECT_FALSE(rule.ask(1024 * kMiB, true, 64 * kMiB, false, false, kT0 + 1000ms).held_back);
  // Requests within the share are never held back.
  EXPECT_FALSE(rule.ask(0, true, 64 * kMiB, false, false, kT0 + 1ms).held_back);
}

TEST(GrowthRule, ARefusedLeaseWithinTheShareStartsNoBackoff) {
  GrowthRule rule(1024 * kMiB);
  auto a = rule.ask(0, true, 64 * kMiB, false, false, kT0);
  rule.refused_for_space(a, kT0);
  EXPECT_FALSE(rule.ask(1024 * kMiB, true, 64 * kMiB, false, false, kT0 + 1ms).held_back);
}

TEST(GrowthRule, OnlyALastResortWithNothingToSpillIsNeeded) {
  GrowthRule rule(1024 * kMiB);
  GrowthRule::Clock::time_point t = kT0;
  rule.refused_for_space(rule.ask(2048 * kMiB, true, 64 * kMiB, false, false, t), t);
  // The cache's last resort while spilling may still help: growth, held back.
  auto a = rule.ask(2048 * kMiB, true, 64 * kMiB, true, false, t);
  EXPECT_TRUE(a.growth);
  EXPECT_TRUE(a.held_back);
  EXPECT_FALSE(a.needed);
  // Nothing left to spill: needed, waits, never held back.
  auto b = rule.ask(2048 * kMiB, true, 64 * kMiB, true, true, t);
  EXPECT_TRUE(b.needed);
  EXPECT_FALSE(b.growth);
  EXPECT_FALSE(b.held_back);
  EXPECT_EQ(b.wait_ms, -1);
  // Nothing to spill, but not the cache's last resort: still growth.
  EXPECT_FALSE(rule.ask(2048 * kMiB, true, 64 * kMiB, false, true, t).needed);
}

TEST(GrowthRule, WithNoShareKnownEveryLastResortIsNeededAndNothingIsGrowth) {
  GrowthRule rule(0);
  auto a = rule.ask(UINT64_MAX / 2, true, 64 * kMiB, false, false, kT0);
  EXPECT_FALSE(a.growth);
  EXPECT_EQ(a.wait_ms, -1);
  EXPECT_TRUE(rule.ask(0, true, 64 * kMiB, true, false, kT0).needed);
}

TEST(GrowthRule, UnknownLeasedBytesCountAsWithinTheShare) {
  GrowthRule rule(1024 * kMiB);
  auto a = rule.ask(0, false, 4096 * kMiB, false, false, kT0);
  EXPECT_FALSE(a.growth);
  EXPECT_EQ(a.wait_ms, -1);
}

}  // namespace
