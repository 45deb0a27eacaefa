// Row gathers: out[i] = src[index[i]] for whole rows of a contiguous
// matrix. The data loader builds batches this way from a dataset resident on
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
#define LEASEHOLD_GATHER_KERNELS(NS)                                                        \
  namespace NS {                                                                           \
  void take_rows(Stream s, void* out, const void* src, const int64_t* index, int64_t count, \
                 int64_t row_bytes);                                                       \
  }
LEASEHOLD_GATHER_KERNELS(cpu)
#ifdef LEASEHOLD_HAVE_CUDA
LEASEHOLD_GATHER_KERNELS(cuda)
#endif
#undef LEASEHOLD_GATHER_KERNELS

}  // namespace leasehold::kernels
