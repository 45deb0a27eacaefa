#include "shared/session_token.h"

#include <sys/random.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <string>

namespace leasehold {

SessionToken SessionToken::random() {
  SessionToken t;
  while (t.empty()) {
    uint64_t words[2];
    size_t got = 0;
    while (got < sizeof words) {
      ssize_t n = ::getrandom(reinterpret_cast<char*>(words) + got, sizeof words - got, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) {
        throw std::runtime_error(std::string("getrandom failed: ") + std::strerror(errno));
      }
      got += static_cast<size_t>(n);
    }
    t.lo = words[0];
    t.hi = words[1];
  }
  return t;
}

}  // namespace leasehold
