// Pattern fill/verify over a lease's memory, on whichever backend holds it
// (CPU kernels on host, CUDA kernels on the per-thread stream on cuda).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lease_client/session.h"

namespace leasehold {

// Fills the whole lease with the pattern of `seed`. Throws on CUDA errors.
void fill_lease_pattern(const Lease& lease, uint64_t seed);
// Words of the lease that differ from the pattern of `seed`.
size_t count_lease_mismatches(const Lease& lease, uint64_t seed);

}  // namespace leasehold
