// Rounding of byte counts to a unit, for the block cache's parts: block
// sizes to the granularity, lease sizes to the lease alignment.
#pragma once

#include <cstdint>

namespace leasehold::torch_plugin::detail {

// Multiples of any nonzero `unit` (lease alignments need not be powers of
// two). 0 when rounding up overflows.
inline uint64_t round_up(uint64_t v, uint64_t unit) {
  uint64_t r = v % unit;
  if (r == 0) return v;
  uint64_t add = unit - r;
  return v > UINT64_MAX - add ? 0 : v + add;
}
inline uint64_t round_down(uint64_t v, uint64_t unit) { return v - v % unit; }

}  // namespace leasehold::torch_plugin::detail
