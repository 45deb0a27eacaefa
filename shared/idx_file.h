// IDX files (MNIST, Fashion-MNIST), plain or gzipped: the header and the
// body. Used by the engine to load datasets and by job validation, which
// only needs the dimensions, in the client, the coordinator and the agent.
#pragma once

#include <zlib.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace leasehold {

// An open IDX file of unsigned bytes (element type 0x08) whose header has
// been read. Not thread-safe.
class IdxFile {
 public:
  // Opens `path` and reads its header. Throws std::runtime_error naming the
  // file for a missing or unreadable file, something that is not a regular
  // file (a FIFO or a device would block or never end), a wrong magic
  // number or element type, or implausible dimensions.
  explicit IdxFile(const std::string& path);
  ~IdxFile();
  IdxFile(const IdxFile&) = delete;
  IdxFile& operator=(const IdxFile&) = delete;

  const std::vector<int64_t>& dims() const { return dims_; }
  // Product of the dimensions: the bytes of the body.
  size_t body_bytes() const;
  // Reads the whole body into `dst` (body_bytes() bytes). Throws naming the
  // file when it is truncated or unreadable.
  void read_body(void* dst);
  // Reads the next `bytes` of the body into `dst` (a body read in pieces).
  // Throws like read_body.
  void read_next(void* dst, size_t bytes);

 private:
  void read_header();
  void read(void* dst, size_t n, const char* what);

  std::string path_;
  gzFile file_ = nullptr;
  std::vector<int64_t> dims_;
};

// Only the dimensions, with IdxFile's errors.
std::vector<int64_t> read_idx_dims(const std::string& path);

}  // namespace leasehold
