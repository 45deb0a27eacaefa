// An agent's session token: 128 bits from the kernel's CSPRNG, given in
// RegisterAck and presented in the header of every later message. Nobody
// can derive another agent's token from their own (the tokens used to count
// up) or guess one.
#pragma once

#include <cstdint>

namespace leasehold {

struct SessionToken {
  uint64_t lo = 0, hi = 0;

  bool empty() const { return (lo | hi) == 0; }
  // No early exit: the time taken says nothing about how much matched.
  friend bool operator==(const SessionToken& a, const SessionToken& b) {
    return ((a.lo ^ b.lo) | (a.hi ^ b.hi)) == 0;
  }
  friend bool operator!=(const SessionToken& a, const SessionToken& b) { return !(a == b); }

  // 16 bytes from getrandom(2); never empty. Throws std::runtime_error when
  // the kernel cannot provide them.
  static SessionToken random();
};

}  // namespace leasehold
