// Strided indexing shared by CPU loops and CUDA kernels: maps the linear index
// of a contiguous output element to the element offset in an input that may be
// a view (any strides, stride 0 for broadcast dimensions).
#pragma once

#include <cstdint>

#include "kernels/pattern.h"  // LEASEHOLD_HOST_DEVICE

namespace leasehold::kernels {

inline constexpr int kMaxDims = 8;

struct Strided {
  int ndim = 0;
  int64_t sizes[kMaxDims] = {};
  int64_t strides[kMaxDims] = {};  // in elements
  int64_t offset = 0;              // in elements
  // Set when strides are the row-major ones of sizes: element i is at
  // offset + i, which skips the per-dimension divisions (the common case).
  bool contiguous = false;

  // Offset of element `linear` (row-major over `sizes`).
  LEASEHOLD_HOST_DEVICE int64_t at(int64_t linear) const {
    if (contiguous) return offset + linear;
    int64_t off = offset;
    for (int d = ndim - 1; d >= 0; --d) {
      int64_t i = linear % sizes[d];
      linear /= sizes[d];
      off += i * strides[d];
    }
    return off;
  }

  // Sets `contiguous` from sizes and strides.
  LEASEHOLD_HOST_DEVICE void detect_contiguous() {
    int64_t expected = 1;
    contiguous = true;
    for (int d = ndim - 1; d >= 0; --d) {
      if (sizes[d] != 1 && strides[d] != expected) contiguous = false;
      expected *= sizes[d];
    }
  }
};

}  // namespace leasehold::kernels
