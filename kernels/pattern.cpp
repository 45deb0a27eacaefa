#include "kernels/pattern.h"

namespace leasehold::kernels {

void fill_pattern_cpu(uint64_t* dst, size_t words, uint64_t seed, uint64_t first_index) {
  for (size_t i = 0; i < words; ++i) dst[i] = pattern_word(seed, first_index + i);
}

size_t count_mismatches_cpu(const uint64_t* src, size_t words, uint64_t seed,
                            uint64_t first_index) {
  size_t bad = 0;
  for (size_t i = 0; i < words; ++i) bad += src[i] != pattern_word(seed, first_index + i);
  return bad;
}

}  // namespace leasehold::kernels
