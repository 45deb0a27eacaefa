// Pattern kernels: fill memory with a position-dependent pattern and count the
// words that differ from it. Agents use them to prove that what they wrote
// into their leases is still there and that nobody else's writes reached it.
// The CPU and CUDA versions compute the same function (tests compare them).
#pragma once

#include <cstddef>
#include <cstdint>

#ifdef __CUDACC__
#define LEASEHOLD_HOST_DEVICE __host__ __device__
#else
#define LEASEHOLD_HOST_DEVICE
#endif

namespace leasehold::kernels {

// The expected value of word `index` for `seed` (splitmix64 of both), so that
// two agents' patterns differ everywhere and a shifted copy is detected.
LEASEHOLD_HOST_DEVICE inline uint64_t pattern_word(uint64_t seed, uint64_t index) {
  uint64_t z = seed + (index + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Writes pattern_word(seed, first_index + i) to dst[i] for i < words.
void fill_pattern_cpu(uint64_t* dst, size_t words, uint64_t seed, uint64_t first_index);
// Number of i < words with src[i] != pattern_word(seed, first_index + i).
size_t count_mismatches_cpu(const uint64_t* src, size_t words, uint64_t seed,
                            uint64_t first_index);

}  // namespace leasehold::kernels
