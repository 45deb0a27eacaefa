// Pattern fill/verify over a lease's memory, on whichever backend holds it
// (CPU kernels on host, CUDA kernels on the per-thread stream on cuda).
#pragma once

#include <cstddef>
#include <cstdint>

#include "lease_client/session.h"

namespace leasehold {

// Fills the whole lease with the pattern of `seed`. Throws on CUDA errors.
void fill_lease_pattern(const Lease& lease, uint64_t seed);
// Fills `bytes` at `at`, an address in the pool's range of `backend` on
// `device`, with the pattern of `seed`, whatever is mapped there (the
// agent's stray-write fault injection). Throws on CUDA errors.
void fill_pool_pattern(Backend backend, int device, std::byte* at, size_t bytes, uint64_t seed);
// Words of the lease that differ from the pattern of `seed`.
size_t count_lease_mismatches(const Lease& lease, uint64_t seed);

}  // namespace leasehold
