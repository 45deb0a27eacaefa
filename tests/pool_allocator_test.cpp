#include "shared/pool_allocator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>

namespace leasehold {
namespace {

using End = PoolAllocator::End;
using Block = PoolAllocator::Block;

// Checks every invariant a user of the allocator relies on: blocks inside the
// pool, aligned, not overlapping, free + used covering the pool exactly, free
// neighbours always merged, and the reference model agreeing on what is used.
void check_invariants(const PoolAllocator& a, const std::map<uint64_t, uint64_t>& model) {
  auto used = a.used_blocks();
  auto free = a.free_blocks();
  ASSERT_EQ(used.size(), model.size());
  size_t i = 0;
  for (const auto& [off, size] : model) {
    EXPECT_EQ(used[i].offset, off);
    EXPECT_EQ(used[i].size, size);
    ++i;
  }
  std::vector<std::pair<Block, bool>> all;
  for (auto b : used) all.push_back({b, false});
  for (auto b : free) all.push_back({b, true});
  std::sort(all.begin(), all.end(),
            [](const auto& x, const auto& y) { return x.first.offset < y.first.offset; });
  uint64_t cursor = 0, free_total = 0, largest = 0;
  bool prev_free = false;
  for (const auto& [b, is_free] : all) {
    EXPECT_EQ(b.offset, cursor) << "gap or overlap at " << cursor;
    EXPECT_EQ(b.offset % a.alignment(), 0u);
    EXPECT_EQ(b.size % a.alignment(), 0u);
    EXPECT_GT(b.size, 0u);
    EXPECT_FALSE(prev_free && is_free) << "adjacent free blocks at " << b.offset;
    prev_free = is_free;
    cursor = b.offset + b.size;
    if (is_free) {
      free_total += b.size;
      largest = std::max(largest, b.size);
    }
  }
  EXPECT_EQ(cursor, a.pool_size());
  EXPECT_EQ(free_total, a.free_bytes());
  EXPECT_EQ(largest, a.largest_free());
}

TEST(PoolAllocator, RoundsPoolDownAndRejectsBadAlignment) {
  PoolAllocator a(10 * 4096 + 17, 4096);
  EXPECT_EQ(a.pool_size(), 10u * 4096);
  EXPECT_THROW(PoolAllocator(1 << 20, 3000), std::invalid_argument);
  EXPECT_THROW(PoolAllocator(100, 4096), std::invalid_argument);
}

TEST(PoolAllocator, LowAndHighEnds) {
  PoolAllocator a(16 * 4096, 4096);
  auto lo = a.allocate(1, End::Low);
  auto hi = a.allocate(4096 + 1, End::High);
  ASSERT_TRUE(lo && hi);
  EXPECT_EQ(lo->offset, 0u);
  EXPECT_EQ(lo->size, 4096u);
  EXPECT_EQ(hi->size, 2u * 4096);
  EXPECT_EQ(hi->offset + hi->size, a.pool_size());
}

TEST(PoolAllocator, AllocateAtTakesExactlyAFreeRange) {
  PoolAllocator a(16 * 4096, 4096);
  std::map<uint64_t, uint64_t> model;
  auto mid = a.allocate_at(5 * 4096, 3 * 4096);
  ASSERT_TRUE(mid);
  EXPECT_EQ(mid->offset, 5u * 4096);
  model[mid->offset] = mid->size;
  check_invariants(a, model);
  EXPECT_FALSE(a.allocate_at(6 * 4096, 4096)) << "inside a used block";
  EXPECT_FALSE(a.allocate_at(3 * 4096, 3 * 4096)) << "runs into a used block";
  EXPECT_FALSE(a.allocate_at(4096 + 1, 4096)) << "not aligned";
  EXPECT_FALSE(a.allocate_at(15 * 4096, 2 * 4096)) << "past the end";
  EXPECT_FALSE(a.allocate_at(UINT64_MAX - 4095, 4096)) << "an offset near 2^64";
  auto at_end = a.allocate_at(15 * 4096, 1);
  ASSERT_TRUE(at_end);
  model[at_end->offset] = at_end->size;
  auto at_start = a.allocate_at(0, 5 * 4096);
  ASSERT_TRUE(at_start) << "the whole free block before the middle one";
  model[at_start->offset] = at_start->size;
  check_invariants(a, model);
  EXPECT_THROW(a.allocate_at(0, 0), std::invalid_argument);
  for (auto [offset, size] : model) a.free(offset);
  EXPECT_EQ(a.free_block_count(), 1u) << "everything merged again";
  EXPECT_EQ(a.free_bytes(), a.pool_size());
}

TEST(PoolAllocator, BestFitPicksSmallestHole) {
  PoolAllocator a(32 * 4096, 4096);
  // Layout: [A:1][h1:4][B:1][h2:2][C:1][rest]
  auto A = a.allocate(4096, End::Low);
  auto h1 = a.allocate(4 * 4096, End::Low);
  auto B = a.allocate(4096, End::Low);
  auto h2 = a.allocate(2 * 4096, End::Low);
  auto C = a.allocate(4096, End::Low);
  ASSERT_TRUE(A && h1 && B && h2 && C);
  a.free(h1->offset);
  a.free(h2->offset);
  auto x = a.allocate(2 * 4096, End::Low);
  ASSERT_TRUE(x);
  EXPECT_EQ(x->offset, h2->offset) << "2-block request must take the 2-block hole";
  auto y = a.allocate(3 * 4096, End::High);
  ASSERT_TRUE(y);
  EXPECT_EQ(y->offset, h1->offset + 4096) << "high end takes the top of the 4-block hole";
}

TEST(PoolAllocator, ExhaustionAndFullCoalescing) {
  PoolAllocator a(8 * 4096, 4096);
  std::vector<Block> got;
  while (auto b = a.allocate(4096, got.size() % 2 ? End::High : End::Low)) got.push_back(*b);
  EXPECT_EQ(got.size(), 8u);
  EXPECT_EQ(a.free_bytes(), 0u);
  EXPECT_FALSE(a.allocate(1, End::Low));
  // Free in an order that needs merges on both sides.
  for (size_t i : {1, 3, 5, 7, 0, 2, 6, 4}) a.free(got[i].offset);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.largest_free(), a.pool_size());
}

TEST(PoolAllocator, ErrorsOnBadFreeAndZeroSize) {
  PoolAllocator a(8 * 4096, 4096);
  EXPECT_THROW(a.allocate(0, End::Low), std::invalid_argument);
  EXPECT_THROW(a.free(4096), std::invalid_argument);
  auto b = a.allocate(4096, End::Low);
  a.free(b->offset);
  EXPECT_THROW(a.free(b->offset), std::invalid_argument) << "double free must be refused";
  EXPECT_FALSE(a.allocate(UINT64_MAX, End::Low)) << "overflowing size must not wrap";
  EXPECT_FALSE(a.could_ever_fit(9 * 4096));
  EXPECT_TRUE(a.could_ever_fit(8 * 4096));
}

TEST(PoolAllocator, ResizeInPlace) {
  PoolAllocator a(16 * 4096, 4096);
  auto x = a.allocate(2 * 4096, End::Low);
  auto y = a.allocate(2 * 4096, End::Low);
  ASSERT_TRUE(x && y);
  EXPECT_FALSE(a.resize(x->offset, 3 * 4096)) << "next block is in use";
  EXPECT_EQ(a.resize(y->offset, 5 * 4096), 5u * 4096);
  EXPECT_EQ(a.resize(y->offset, 4096), 4096u);
  EXPECT_EQ(a.free_block_count(), 1u) << "shrunk tail merges with the free space after it";
  EXPECT_THROW(a.resize(12345, 4096), std::invalid_argument);
  EXPECT_THROW(a.resize(y->offset, 0), std::invalid_argument);
}

// Random operations checked against a reference model of the used ranges.
class PoolAllocatorRandom : public ::testing::TestWithParam<uint64_t> {};

TEST_P(PoolAllocatorRandom, MatchesReferenceModel) {
  const uint64_t align = GetParam();
  const uint64_t pool = align * 257;
  PoolAllocator a(pool, align);
  std::map<uint64_t, uint64_t> model;  // offset -> size
  std::mt19937_64 rng(align * 7919);
  for (int step = 0; step < 4000; ++step) {
    int op = rng() % 10;
    if (op < 5 || model.empty()) {
      uint64_t size = 1 + rng() % (align * 24);
      End end = rng() % 2 ? End::High : End::Low;
      auto free_before = a.free_blocks();
      auto b = a.allocate(size, end);
      uint64_t need = (size + align - 1) / align * align;
      // Best fit: the chosen block must be the smallest free block that fits.
      uint64_t best = UINT64_MAX;
      for (auto f : free_before) {
        if (f.size >= need) best = std::min(best, f.size);
      }
      if (best == UINT64_MAX) {
        ASSERT_FALSE(b) << "allocated although nothing fits";
        continue;
      }
      ASSERT_TRUE(b) << "refused although a block of " << best << " fits " << need;
      EXPECT_EQ(b->size, need);
      auto host = std::find_if(free_before.begin(), free_before.end(), [&](Block f) {
        return f.offset <= b->offset && b->offset + b->size <= f.offset + f.size;
      });
      ASSERT_NE(host, free_before.end());
      EXPECT_EQ(host->size, best);
      if (end == End::Low) {
        EXPECT_EQ(b->offset, host->offset);
      } else {
        EXPECT_EQ(b->offset + b->size, host->offset + host->size);
      }
      model[b->offset] = b->size;
    } else if (op < 8) {
      auto it = std::next(model.begin(), rng() % model.size());
      a.free(it->first);
      model.erase(it);
    } else {
      auto it = std::next(model.begin(), rng() % model.size());
      uint64_t want = 1 + rng() % (align * 24);
      auto r = a.resize(it->first, want);
      if (r) it->second = *r;
    }
    if (step % 50 == 0) check_invariants(a, model);
  }
  check_invariants(a, model);
  for (const auto& [off, size] : model) a.free(off);
  EXPECT_EQ(a.free_block_count(), 1u);
  EXPECT_EQ(a.free_bytes(), a.pool_size());
}

INSTANTIATE_TEST_SUITE_P(Alignments, PoolAllocatorRandom,
                         ::testing::Values(256, 4096, 2u << 20));

}  // namespace
}  // namespace leasehold
