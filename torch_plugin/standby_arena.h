// The warm-up memory of a Python standby (agent/python_standby.h): before a
// standby has a job it has no session, yet warming PyTorch up (cuBLAS's
// workspace, a training step's kernels) allocates. While the arena is open
// those allocations are plain cudaMalloc's, freed with cudaFree. The
// standby closes it once its warm-up objects are gone; from then on every
// allocation comes from the job's leases. Closing reports what is still
// live, which the standby treats as a failed warm-up: a job never starts
// beside memory from outside the pool.
#pragma once

#include <cstdint>

namespace leasehold::torch_plugin {

// Opens the arena; false (with a line on standard error) once the job's
// session is open or after the arena was closed: it opens once.
bool standby_arena_open();
// Closes it: the bytes still allocated from it (0: none).
uint64_t standby_arena_close();
// Whether allocations go to the arena now.
bool standby_arena_active();
// An allocation from the arena on `device`; throws std::runtime_error
// ("leasehold: ...") when cudaMalloc fails.
void* standby_arena_allocate(uint64_t bytes, int device);
// Frees `ptr` when the arena made it (true); false for any other pointer.
// Never throws (a failing cudaFree is printed).
bool standby_arena_free(void* ptr);

}  // namespace leasehold::torch_plugin
