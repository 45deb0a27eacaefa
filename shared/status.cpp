#include "shared/status.h"

#include <cstring>
#include <utility>

namespace leasehold {

Status Status::io_error(std::string context, int errno_value) {
  // glibc's strerror is thread-safe (per-thread buffer for unknown values).
  context += ": ";
  context += std::strerror(errno_value);
  return Status(Code::IoError, std::move(context), errno_value);
}

Status Status::not_found(std::string message) {
  return Status(Code::NotFound, std::move(message), 0);
}

Status Status::corruption(std::string message) {
  return Status(Code::Corruption, std::move(message), 0);
}

Status Status::invalid_argument(std::string message) {
  return Status(Code::InvalidArgument, std::move(message), 0);
}

std::string Status::to_string() const {
  switch (code_) {
    case Code::Ok:
      return "OK";
    case Code::NotFound:
      return "Not found: " + message_;
    case Code::Corruption:
      return "Corruption: " + message_;
    case Code::InvalidArgument:
      return "Invalid argument: " + message_;
    case Code::IoError:
      return "IO error: " + message_;
  }
  return message_;
}

}  // namespace leasehold
