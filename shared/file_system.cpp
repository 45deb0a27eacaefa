#include "shared/file_system.h"

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <mutex>
#include <system_error>

namespace leasehold {
namespace {

// open(2) that retries when a signal interrupts it (possible on slow file
// systems such as NFS).
int open_retrying(const char* path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::open(path, flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// For a descriptor opened with O_NONBLOCK: an error unless it is a regular
// file; then back to blocking I/O (some network file systems return EAGAIN
// otherwise).
Status regular_and_blocking(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return Status::io_error("cannot stat " + path, errno);
  if (!S_ISREG(st.st_mode)) return Status::invalid_argument(path + ": not a regular file");
  if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) {
    return Status::io_error("cannot use " + path, errno);
  }
  return Status::OK();
}

int fsync_retrying(int fd) {
  int rc;
  do {
    rc = ::fsync(fd);
  } while (rc != 0 && errno == EINTR);
  return rc;
}

// not_found with the same wording as an I/O error: "<context>: No such file...".
Status missing(const std::string& context) {
  return Status::not_found(context + ": " + std::strerror(ENOENT));
}

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(int fd, std::string path) : fd_(fd), path_(std::move(path)) {}
  ~PosixWritableFile() override {
    if (fd_ >= 0) ::close(fd_);
  }

  Status append(std::string_view data) override {
    if (fd_ < 0) return closed("write");
    while (!data.empty()) {
      ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        return Status::io_error("cannot write " + path_, errno);
      }
      data.remove_prefix(static_cast<size_t>(n));
    }
    return Status::OK();
  }

  Status sync() override {
    if (fd_ < 0) return closed("fsync");
    if (fsync_retrying(fd_) != 0) return Status::io_error("cannot fsync " + path_, errno);
    return Status::OK();
  }

  Status close() override {
    if (fd_ < 0) return closed("close");
    // Not retried on EINTR: Linux releases the descriptor whatever close()
    // returns, and a retry could close one that another thread just opened.
    int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0 && errno != EINTR) return Status::io_error("cannot close " + path_, errno);
    return Status::OK();
  }

 private:
  Status closed(const char* what) const {
    return Status::invalid_argument("cannot " + std::string(what) + " " + path_ +
                                    ": file already closed");
  }

  int fd_;
  std::string path_;
};

class PosixFileSystem final : public FileSystem {
 public:
  Status new_writable_file(const std::string& path, std::unique_ptr<WritableFile>* out) override {
    // Neither through a link nor into a FIFO someone placed there (opening
    // one for writing without a reader fails at once with O_NONBLOCK):
    // only a regular file is written.
    int fd = open_retrying(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK,
                           0644);
    if (fd < 0) return Status::io_error("cannot create " + path, errno);
    if (Status st = regular_and_blocking(fd, path); !st.ok()) {
      ::close(fd);
      return st;
    }
    *out = std::make_unique<PosixWritableFile>(fd, path);
    return Status::OK();
  }

  Status read_file(const std::string& path, std::string* contents,
                   size_t max_bytes = SIZE_MAX) override {
    // Without blocking: a FIFO (or a device) named as a file must not hang
    // the reader; only a regular file is read.
    int fd = open_retrying(path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) {
      if (errno == ENOENT) return missing("cannot open " + path);
      return Status::io_error("cannot open " + path, errno);
    }
    contents->clear();
    if (Status st = regular_and_blocking(fd, path); !st.ok()) {
      ::close(fd);
      return st;
    }
    auto too_large = [&] {
      ::close(fd);
      return Status::io_error(path + " holds more than " + std::to_string(max_bytes) + " bytes",
                              EFBIG);
    };
    struct stat st {};
    if (::fstat(fd, &st) == 0 && st.st_size > 0) {
      if (static_cast<uint64_t>(st.st_size) > max_bytes) return too_large();
      contents->reserve(static_cast<size_t>(st.st_size));
    }
    char buf[1 << 16];
    for (;;) {
      ssize_t n = ::read(fd, buf, sizeof buf);
      if (n == 0) break;
      if (n < 0) {
        if (errno == EINTR) continue;
        int err = errno;
        ::close(fd);
        return Status::io_error("cannot read " + path, err);
      }
      if (static_cast<size_t>(n) > max_bytes - contents->size()) return too_large();  // it grew
      contents->append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    return Status::OK();
  }

  Status rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) {
      return Status::io_error("cannot rename " + from + " to " + to, errno);
    }
    return Status::OK();
  }

  Status remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) {
      if (errno == ENOENT) return missing("cannot remove " + path);
      return Status::io_error("cannot remove " + path, errno);
    }
    return Status::OK();
  }

  Status sync_dir(const std::string& dir) override {
    const char* name = dir.empty() ? "." : dir.c_str();
    int fd = open_retrying(name, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return Status::io_error("cannot open directory " + std::string(name), errno);
    int rc = fsync_retrying(fd);
    int err = errno;
    ::close(fd);
    // Some file systems (several FUSE and network ones) cannot fsync a
    // directory and say EINVAL: there is nothing more to make durable there.
    if (rc != 0 && err != EINVAL) {
      return Status::io_error("cannot fsync directory " + std::string(name), err);
    }
    if (rc != 0) {
      static std::once_flag warned;
      std::call_once(warned, [&] {
        spdlog::warn("the file system of {} cannot fsync directories: a rename there survives a "
                     "power loss only as far as the file system guarantees it",
                     name);
      });
    }
    return Status::OK();
  }

  Status create_dirs(const std::string& dir) override {
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::io_error("cannot create directory " + dir, ec.value());
    return Status::OK();
  }

  bool exists(const std::string& path) override {
    struct stat st;
    return ::stat(path.c_str(), &st) == 0;
  }
};

}  // namespace

FileSystem& default_file_system() {
  // Never destroyed, so that it stays usable from other static destructors.
  static auto* fs = new PosixFileSystem;
  return *fs;
}

}  // namespace leasehold
