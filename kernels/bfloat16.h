// bfloat16: the top 16 bits of an IEEE float32 (8 exponent bits, 7 of
// mantissa), the storage type of mixed-precision GEMM inputs. Conversions
// from float round to nearest, ties to even, and keep NaNs NaN; to float
// they are exact. The same code on the host and the device.
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/pattern.h"  // LEASEHOLD_HOST_DEVICE

namespace leasehold::kernels {

struct bfloat16 {
  uint16_t bits = 0;

  bfloat16() = default;
  LEASEHOLD_HOST_DEVICE explicit bfloat16(float f) : bits(round(f)) {}
  LEASEHOLD_HOST_DEVICE operator float() const {
    const uint32_t u = static_cast<uint32_t>(bits) << 16;
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
#endif
  }

  LEASEHOLD_HOST_DEVICE static uint16_t round(float f) {
#ifdef __CUDA_ARCH__
    uint32_t u = __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
#endif
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
  }
};
static_assert(sizeof(bfloat16) == 2);

}  // namespace leasehold::kernels
