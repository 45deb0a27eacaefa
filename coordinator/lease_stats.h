// Counts of what became of lease requests since the coordinator started, and
// how long granted ones waited: the counters and the histogram of /metrics.
// Plain cumulative numbers the core bumps; the HTTP endpoint reads a copy.
#pragma once

#include <array>
#include <cstdint>

namespace leasehold {

struct LeaseStats {
  // Upper bounds (seconds) of the grant-latency buckets. A request that fits
  // at once waits 0 s; waiting ones take from milliseconds (a release) to
  // the lease wait timeout (30 s by default, 10 min at most).
  static constexpr std::array<double, 12> kBounds{0.001, 0.005, 0.01, 0.05, 0.1, 0.25,
                                                  0.5,   1,     2.5,  5,    10,  30};

  uint64_t grants = 0;    // granted, at once or after waiting
  uint64_t refusals = 0;  // refused (too large, no memory and no wait, policy)
  uint64_t timeouts = 0;  // waited until their deadline and were refused then
  // buckets[i]: grants that waited at most kBounds[i] (not cumulative);
  // the last slot counts the ones above every bound.
  std::array<uint64_t, kBounds.size() + 1> buckets{};
  double waited_seconds = 0;  // sum over all grants

  void granted(double seconds) {
    ++grants;
    waited_seconds += seconds;
    size_t i = 0;
    while (i < kBounds.size() && seconds > kBounds[i]) ++i;
    ++buckets[i];
  }
};

}  // namespace leasehold
