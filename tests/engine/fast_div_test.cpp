// kernels/fast_div.h: the multiply-and-shift division the small CUDA
// kernels index with, checked against `/` on the host (the same formula).
#include <gtest/gtest.h>

#include <climits>
#include <random>

#include "kernels/fast_div.h"

namespace leasehold::kernels {
namespace {

TEST(FastDiv, AgreesWithDivisionOverTheWholeRange) {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> any(0, INT_MAX);
  std::vector<int> divisors;
  for (int d = 1; d <= 2048; ++d) divisors.push_back(d);
  for (int shift = 11; shift < 31; ++shift) {
    const int p = 1 << shift;
    divisors.insert(divisors.end(), {p - 1, p, p + 1});
  }
  divisors.push_back(INT_MAX);
  for (int i = 0; i < 200; ++i) divisors.push_back(any(rng) | 1);
  for (int d : divisors) {
    const FastDiv f(d);
    ASSERT_EQ(f.divisor(), d);
    // The edges of quotients (multiples of d and one below), the largest
    // dividend, and random ones.
    std::vector<int> ns = {0, 1, d - 1, d, INT_MAX, INT_MAX - 1, INT_MAX - d + 1};
    for (int64_t k : {int64_t{2}, int64_t{3}, int64_t{1000}, int64_t{INT_MAX} / d}) {
      if (k * d <= INT_MAX) ns.insert(ns.end(), {int(k * d), int(k * d - 1)});
    }
    for (int i = 0; i < 300; ++i) ns.push_back(any(rng));
    for (int n : ns) {
      if (n < 0) continue;
      int rest = -1;
      ASSERT_EQ(f.divide(n, rest), n / d) << n << " / " << d;
      ASSERT_EQ(rest, n % d) << n << " % " << d;
    }
  }
  // Every dividend below 2^20 for the divisors the LeNet kernels use.
  for (int d : {2, 5, 7, 10, 14, 17, 21, 25, 28, 35, 150, 784}) {
    const FastDiv f(d);
    for (int n = 0; n < (1 << 20); ++n) ASSERT_EQ(f.divide(n), n / d) << n << " / " << d;
  }
}

TEST(FastDiv, RefusesADivisorThatIsNotPositive) {
  EXPECT_THROW(FastDiv(0), std::invalid_argument);
  EXPECT_THROW(FastDiv(-3), std::invalid_argument);
}

}  // namespace
}  // namespace leasehold::kernels
