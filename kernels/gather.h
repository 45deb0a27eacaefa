// Row gathers: out[i] = src[index[i]] for whole rows of a contiguous
// matrix, and windows of a byte sequence. The data loader builds batches this way from a dataset resident on
// the device (a shared cache region), so a batch costs no host work and no
// host-to-device copy.
#pragma once

#include <cstdint>

#include "kernels/stream.h"

namespace leasehold::kernels {

// REQUIRES: every index in [0, rows of src) (the caller builds or checks
// them; nothing is checked on the device). `index` lives on the kernel's
// device. On CUDA, rows move 16 bytes at a time when their size and the
// pointers allow it.
//
// take_byte_windows: windows of a byte sequence, widened to int64:
// out[i * width + t] = bytes[index[i] * stride + offset + t] (a text
// corpus's next-token samples: its tokens at offset 0, their successors at
// offset 1). REQUIRES: every window inside `bytes`.
#define LEASEHOLD_GATHER_KERNELS(NS)                                                        \
  namespace NS {                                                                           \
  void take_rows(Stream s, void* out, const void* src, const int64_t* index, int64_t count, \
                 int64_t row_bytes);                                                       \
  void take_byte_windows(Stream s, int64_t* out, const uint8_t* bytes, const int64_t* index, \
                         int64_t count, int64_t width, int64_t stride, int64_t offset);     \
  }
LEASEHOLD_GATHER_KERNELS(cpu)
#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_GATHER_KERNELS(cuda)
#endif
#undef LEASEHOLD_GATHER_KERNELS

}  // namespace leasehold::kernels
