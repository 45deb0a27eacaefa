// The result of an operation that reports failure as a value rather than an
// exception (LevelDB's Status): used across interfaces such as FileSystem,
// whose implementations, fakes included, must never throw through them.
// Success costs no allocation; a failure carries a message for humans and,
// for I/O errors, the errno so that callers and tests can branch on it.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

namespace leasehold {

class [[nodiscard]] Status {
 public:
  // Success. Same as OK().
  Status() noexcept = default;

  // Success. Spelled in capitals as in LevelDB: C++ cannot overload a static
  // ok() factory with the ok() query below.
  static Status OK() noexcept { return Status(); }
  // An operating-system failure: message "<context>: <strerror(errno_value)>",
  // e.g. io_error("cannot write /a/b.tmp", ENOSPC). Keeps errno_value.
  static Status io_error(std::string context, int errno_value);
  // The named thing does not exist (a file to read or remove).
  static Status not_found(std::string message);
  // Data was read but is not what it should be (bad checksum, truncation).
  static Status corruption(std::string message);
  // The caller asked for something impossible (writing to a closed file).
  static Status invalid_argument(std::string message);

  bool ok() const noexcept { return code_ == Code::Ok; }
  bool is_not_found() const noexcept { return code_ == Code::NotFound; }
  bool is_io_error() const noexcept { return code_ == Code::IoError; }
  bool is_corruption() const noexcept { return code_ == Code::Corruption; }
  bool is_invalid_argument() const noexcept { return code_ == Code::InvalidArgument; }
  // The errno of an I/O error; 0 for success and every other kind.
  int error_number() const noexcept { return errno_; }
  // The message without a kind prefix; empty for success.
  const std::string& message() const noexcept { return message_; }
  // "OK", or the kind and the message: "IO error: cannot write ...".
  std::string to_string() const;

 private:
  enum class Code : uint8_t { Ok, NotFound, Corruption, InvalidArgument, IoError };
  Status(Code code, std::string message, int errno_value)
      : code_(code), errno_(errno_value), message_(std::move(message)) {}

  Code code_ = Code::Ok;
  int errno_ = 0;
  std::string message_;
};

}  // namespace leasehold
