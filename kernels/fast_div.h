// Division of non-negative 32-bit ints by a divisor fixed before a kernel
// starts, as a multiply and a shift. A GPU has no integer divider: `n / d`
// for a run-time d is a sequence of about twenty instructions, and the
// small convolution and pooling kernels did several per element they
// staged or wrote.
//
// The divisor's multiplier m = ceil(2^(31 + l) / d), l = ceil(log2 d), makes
// floor(n · m / 2^(32 + l - 1)) = floor(n / d) for every 0 <= n < 2^31 (the
// round-up method of Granlund and Montgomery, "Division by invariant
// integers using multiplication", 1994).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

#include "kernels/pattern.h"  // LEASEHOLD_HOST_DEVICE

namespace leasehold::kernels {

class FastDiv {
 public:
  FastDiv() = default;
  explicit FastDiv(int divisor) : d_(divisor) {
    if (divisor < 1) {
      throw std::invalid_argument("FastDiv: divisor " + std::to_string(divisor) +
                                  " is not positive");
    }
    int l = 0;
    while ((int64_t{1} << l) < divisor) ++l;
    const uint64_t p = uint64_t{1} << (31 + l);
    mul_ = uint32_t((p + uint64_t(divisor) - 1) / uint64_t(divisor));
    shift_ = l - 1;  // -1 for a divisor of 1, which divide() passes by
  }

  LEASEHOLD_HOST_DEVICE int divisor() const { return d_; }

  // n / d for 0 <= n < 2^31.
  LEASEHOLD_HOST_DEVICE int divide(int n) const {
    if (d_ == 1) return n;
#ifdef __CUDA_ARCH__
    return int(__umulhi(uint32_t(n), mul_) >> shift_);
#else
    return int(((uint64_t(uint32_t(n)) * mul_) >> 32) >> shift_);
#endif
  }
  // The quotient, and n - quotient · d in `rest`.
  LEASEHOLD_HOST_DEVICE int divide(int n, int& rest) const {
    const int q = divide(n);
    rest = n - q * d_;
    return q;
  }

 private:
  int d_ = 1;
  uint32_t mul_ = 0;
  int shift_ = 0;
};

}  // namespace leasehold::kernels
