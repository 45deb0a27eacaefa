// Launch helpers shared by the CUDA kernels: block size, grid sizing with a
// ceiling division capped so grid-stride loops cover any size.
#pragma once

#include <algorithm>
#include <cstdint>

#include "shared/cuda_check.h"

namespace leasehold::kernels {

inline constexpr int kBlock = 256;

// Enough blocks to cover n (ceiling division), capped: grid-stride loops do
// the rest, and more blocks than a few waves of the GPU buy nothing.
inline unsigned grid_for(int64_t n) {
  int64_t blocks = (n + kBlock - 1) / kBlock;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65535));
}

}  // namespace leasehold::kernels
