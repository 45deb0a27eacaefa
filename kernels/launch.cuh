// Launch helpers shared by the CUDA kernels: block size, grid sizing with a
// ceiling division capped so grid-stride loops cover any size.
#pragma once

#include <algorithm>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "kernels/stream.h"
#include "shared/cuda_check.h"

namespace leasehold::kernels {

inline constexpr int kBlock = 256;

// Enough blocks to cover n (ceiling division), capped: grid-stride loops do
// the rest, and more blocks than a few waves of the GPU buy nothing.
inline unsigned grid_for(int64_t n) {
  int64_t blocks = (n + kBlock - 1) / kBlock;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65535));
}

// 16 bytes of T, loaded and stored as one word: the contiguous fast paths
// move these (each thread keeps more bytes in flight for the same number of
// instructions).
template <class T>
struct alignas(16) Word {
  static constexpr int kLanes = 16 / sizeof(T);
  T v[kLanes];
};

// The CUDA stream behind a kernel's Stream argument.
inline cudaStream_t as_cuda(Stream s) { return static_cast<cudaStream_t>(s); }

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace leasehold::kernels
