#include "agent/spill/spill_file.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <string_view>
#include <system_error>

#include "shared/process.h"
#include "shared/units.h"

namespace leasehold::spill {
namespace {

constexpr uint64_t kGrowStep = 256ull << 20;     // fallocate ahead by this much at least
constexpr uint64_t kUnlimitedFile = 1ull << 50;  // the extent pool when there is no limit

std::string bytes_text(uint64_t n) { return std::to_string(n) + " bytes"; }

// pwrite/pread of exactly `n` bytes, resuming after short transfers and
// signals. Returns 0 or the errno; -1 from read_exact means end of file.
int write_exact(int fd, const char* p, size_t n, uint64_t offset) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (w == 0) return EIO;  // no progress and no error: do not spin
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
  return 0;
}

int read_exact(int fd, char* p, size_t n, uint64_t offset) {
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno;
    }
    if (r == 0) return -1;
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return 0;
}

int fallocate_retrying(int fd, uint64_t offset, uint64_t length) {
  int rc;
  do {
    rc = ::fallocate(fd, 0, static_cast<off_t>(offset), static_cast<off_t>(length));
  } while (rc != 0 && errno == EINTR);
  return rc == 0 ? 0 : errno;
}

}  // namespace

Status SpillFile::create(const std::string& directory, const std::string& tag, bool direct_io,
                         uint64_t limit, std::unique_ptr<SpillFile>* out) {
  if (limit != 0 && limit < kPage) {
    return Status::invalid_argument("spill file limit of " + bytes_text(limit) +
                                    " is smaller than one 4 KiB extent");
  }
  std::string path = directory + "/spill-" + std::to_string(::getpid()) + "-" + tag + ".bin";
  int flags = O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC;
  int fd;
  do {
    fd = ::open(path.c_str(), flags | (direct_io ? O_DIRECT : 0), 0600);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0 && errno == EINVAL && direct_io) {
    // The file system refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE
    // ones). Linux checks that after creating the file, and O_EXCL had ruled
    // out an older file of that name, so the one there now is ours.
    ::unlink(path.c_str());
    do {
      fd = ::open(path.c_str(), flags, 0600);
    } while (fd < 0 && errno == EINTR);
    if (fd >= 0) {
      static std::once_flag warned;
      std::call_once(warned, [&] {
        spdlog::warn(
            "the file system of {} refuses O_DIRECT: spilled tensors go through the "
            "page cache there",
            directory);
      });
    }
  }
  if (fd < 0) return Status::io_error("cannot create spill file " + path, errno);
  out->reset(new SpillFile(fd, std::move(path), directory, limit));
  return Status::OK();
}

SpillFile::SpillFile(int fd, std::string path, std::string directory, uint64_t limit)
    : fd_(fd),
      path_(std::move(path)),
      directory_(std::move(directory)),
      limit_(limit),
      extents_(limit ? limit : kUnlimitedFile, kPage) {}

SpillFile::~SpillFile() {
  if (::close(fd_) != 0) spdlog::error("cannot close spill file {}: {}", path_, strerror(errno));
  if (::unlink(path_.c_str()) != 0) {
    spdlog::error("cannot remove spill file {}: {}", path_, strerror(errno));
  }
}

std::optional<uint64_t> SpillFile::place(uint64_t bytes) {
  auto ext = extents_.allocate(bytes, PoolAllocator::End::Low);
  if (!ext) return std::nullopt;
  return ext->offset;
}

std::string SpillFile::fullness() const {
  return "spill file " + path_ + " has " + format_bytes(extents_.used_bytes()) + " in use" +
         (limit_ ? " of its limit of " + format_bytes(limit_)
                 : std::string(" (no room left in its address space)"));
}

Status SpillFile::grow_to(uint64_t end) {
  if (end <= size_) return Status::OK();
  uint64_t target = std::max(size_ + kGrowStep, end);
  if (limit_) target = std::min<uint64_t>(target, limit_);
  int err = fallocate_retrying(fd_, size_, target - size_);
  if (err == ENOSPC && target > end) {
    // The disk cannot take the step ahead but may still take what is needed.
    target = end;
    err = fallocate_retrying(fd_, size_, target - size_);
  }
  if (err == EOPNOTSUPP) {
    // No fallocate on this file system: extend the size and let writes
    // allocate (a full disk then shows up as a failed write).
    static std::once_flag warned;
    std::call_once(warned, [&] {
      spdlog::warn("the file system of {} cannot preallocate spill files", directory_);
    });
    err = ::ftruncate(fd_, static_cast<off_t>(target)) == 0 ? 0 : errno;
  }
  if (err != 0) {
    return Status::io_error("cannot grow spill file " + path_ + " from " + bytes_text(size_) +
                                " to " + bytes_text(target),
                            err);
  }
  size_ = target;
  return Status::OK();
}

int SpillFile::write(const char* p, size_t n, uint64_t offset) const {
  return write_exact(fd_, p, n, offset);
}

int SpillFile::read(char* p, size_t n, uint64_t offset) const {
  return read_exact(fd_, p, n, offset);
}

int remove_stale_spill_files(const std::string& directory) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::directory_iterator it(directory, ec);
  if (ec) {
    if (ec != std::errc::no_such_file_or_directory) {
      spdlog::warn("cannot list spill directory {}: {}", directory, ec.message());
    }
    return 0;
  }
  int removed = 0;
  for (; !ec && it != fs::directory_iterator(); it.increment(ec)) {
    std::string name = it->path().filename().string();
    // spill-PID-TAG.bin
    constexpr std::string_view kPrefix = "spill-", kSuffix = ".bin";
    if (name.size() <= kPrefix.size() + kSuffix.size() || !name.starts_with(kPrefix) ||
        !name.ends_with(kSuffix)) {
      continue;
    }
    size_t dash = name.find('-', kPrefix.size());
    if (dash == std::string::npos || dash == kPrefix.size() || dash - kPrefix.size() > 9) continue;
    std::string digits = name.substr(kPrefix.size(), dash - kPrefix.size());
    if (!std::all_of(digits.begin(), digits.end(),
                     [](char ch) { return ch >= '0' && ch <= '9'; })) {
      continue;
    }
    int pid = std::stoi(digits);
    if (pid <= 0 || pid == ::getpid() || !process_gone(pid)) continue;
    std::string path = it->path().string();
    if (::unlink(path.c_str()) != 0) {
      if (errno != ENOENT)
        spdlog::warn("cannot remove stale spill file {}: {}", path, strerror(errno));
      continue;
    }
    spdlog::info("removed stale spill file {} of process {}, which is gone", path, pid);
    ++removed;
  }
  if (ec) spdlog::warn("cannot list spill directory {}: {}", directory, ec.message());
  return removed;
}

}  // namespace leasehold::spill
