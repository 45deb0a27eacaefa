#include "shared/idx_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace leasehold {
namespace {

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
}

// Opens without blocking on a FIFO and refuses anything but a regular file.
int open_regular(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    int err = errno;
    ::close(fd);
    throw std::runtime_error(path + " is not a regular file" +
                             (S_ISREG(st.st_mode) ? std::string(": ") + std::strerror(err) : ""));
  }
  // Back to blocking reads: O_NONBLOCK means nothing for regular files, but
  // zlib should not see EAGAIN from some exotic file system either.
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

}  // namespace

IdxFile::IdxFile(const std::string& path) : path_(path) {
  int fd = open_regular(path);
  // gzread reads plain files as well as gzip ones.
  file_ = gzdopen(fd, "rb");
  if (!file_) {
    ::close(fd);
    throw std::runtime_error("cannot read " + path + ": out of memory");
  }
  try {
    read_header();
  } catch (...) {
    // The destructor does not run for a constructor that throws.
    gzclose(file_);
    file_ = nullptr;
    throw;
  }
}

void IdxFile::read_header() {
  const std::string& path = path_;
  uint8_t magic[4];
  read(magic, 4, "header");
  if (magic[0] != 0 || magic[1] != 0) {
    throw std::runtime_error(path + " is not an IDX file (magic bytes " +
                             std::to_string(magic[0]) + " " + std::to_string(magic[1]) +
                             ", expected 0 0)");
  }
  if (magic[2] != 0x08) {
    throw std::runtime_error(path + ": IDX element type " + std::to_string(magic[2]) +
                             " is not supported (only unsigned bytes, 0x08)");
  }
  int ndims = magic[3];
  if (ndims < 1 || ndims > 4) {
    throw std::runtime_error(path + ": IDX file with " + std::to_string(ndims) + " dimensions");
  }
  size_t total = 1;
  for (int i = 0; i < ndims; ++i) {
    uint8_t b[4];
    read(b, 4, "dimensions");
    uint32_t d = big_endian(b);
    if (d == 0 || d > (1u << 28)) {
      throw std::runtime_error(path + ": implausible dimension " + std::to_string(d));
    }
    dims_.push_back(d);
    total *= d;
    if (total > (size_t(1) << 34)) throw std::runtime_error(path + ": IDX body too large");
  }
}

IdxFile::~IdxFile() {
  if (file_) gzclose(file_);
}

size_t IdxFile::body_bytes() const {
  size_t total = 1;
  for (int64_t d : dims_) total *= static_cast<size_t>(d);
  return total;
}

void IdxFile::read_body(void* dst) { read(dst, body_bytes(), "data"); }

void IdxFile::read_next(void* dst, size_t bytes) { read(dst, bytes, "data"); }

void IdxFile::read(void* dst, size_t n, const char* what) {
  size_t done = 0;
  while (done < n) {
    unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
    int r = gzread(file_, static_cast<char*>(dst) + done, chunk);
    if (r < 0) {
      int err = 0;
      throw std::runtime_error(path_ + ": read error: " + gzerror(file_, &err));
    }
    if (r == 0) {
      throw std::runtime_error(path_ + " is truncated: expected " + std::to_string(n) +
                               " bytes of " + what + ", got " + std::to_string(done));
    }
    done += static_cast<size_t>(r);
  }
}

std::vector<int64_t> read_idx_dims(const std::string& path) { return IdxFile(path).dims(); }

}  // namespace leasehold
