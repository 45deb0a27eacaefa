// The error type that crosses Leasehold's library boundaries. It carries the
// protocol's error code so that a coordinator's Error reply, a client-side
// timeout and a local failure are handled the same way by callers.
#pragma once

#include <stdexcept>
#include <string>

#include "schemas/leasehold_generated.h"

namespace leasehold {

using ErrorCode = proto::ErrorCode;

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

// "TooLarge", "Timeout", ...
inline const char* error_code_name(ErrorCode code) {
  const char* name = proto::EnumNameErrorCode(code);
  return (name && *name) ? name : "Unknown";
}

}  // namespace leasehold
