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

// openat(2) that retries when a signal interrupts it (possible on slow
// file systems such as NFS).
int open_retrying(int dir_fd, const char* path, int flags, mode_t mode = 0) {
  int fd;
  do {
    fd = ::openat(dir_fd, path, flags | O_CLOEXEC, mode);
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

// Paths relative to `dir_fd` (AT_FDCWD: the working folder), as the *at()
// calls resolve them.
class PosixFileSystem final : public FileSystem {
 public:
  // `file_mode`: of files it creates (before the umask).
  explicit PosixFileSystem(int dir_fd = AT_FDCWD, mode_t file_mode = 0644, std::string shown_in = {})
      : dir_fd_(dir_fd), file_mode_(file_mode), shown_in_(std::move(shown_in)) {}

  Status new_writable_file(const std::string& path, std::unique_ptr<WritableFile>* out) override {
    // Neither through a link nor into a FIFO someone placed there (opening
    // one for writing without a reader fails at once with O_NONBLOCK):
    // only a regular file is written.
    int fd = open_retrying(dir_fd_, path.c_str(),
                           O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_NONBLOCK, file_mode_);
    if (fd < 0) return Status::io_error("cannot create " + shown(path), errno);
    if (Status st = regular_and_blocking(fd, shown(path)); !st.ok()) {
      ::close(fd);
      return st;
    }
    *out = std::make_unique<PosixWritableFile>(fd, shown(path));
    return Status::OK();
  }

  Status read_file(const std::string& path, std::string* contents,
                   size_t max_bytes = SIZE_MAX) override {
    // Without blocking: a FIFO (or a device) named as a file must not hang
    // the reader; only a regular file is read.
    int fd = open_retrying(dir_fd_, path.c_str(), O_RDONLY | O_NONBLOCK | O_NOCTTY | read_flags_);
    if (fd < 0) {
      if (errno == ENOENT) return missing("cannot open " + shown(path));
      return Status::io_error("cannot open " + shown(path), errno);
    }
    contents->clear();
    if (Status st = regular_and_blocking(fd, shown(path)); !st.ok()) {
      ::close(fd);
      return st;
    }
    auto too_large = [&] {
      ::close(fd);
      return Status::io_error(shown(path) + " holds more than " + std::to_string(max_bytes) + " bytes",
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
        return Status::io_error("cannot read " + shown(path), err);
      }
      if (static_cast<size_t>(n) > max_bytes - contents->size()) return too_large();  // it grew
      contents->append(buf, static_cast<size_t>(n));
    }
    ::close(fd);
    return Status::OK();
  }

  Status rename(const std::string& from, const std::string& to) override {
    if (::renameat(dir_fd_, from.c_str(), dir_fd_, to.c_str()) != 0) {
      return Status::io_error("cannot rename " + shown(from) + " to " + shown(to), errno);
    }
    return Status::OK();
  }

  Status remove(const std::string& path) override {
    if (::unlinkat(dir_fd_, path.c_str(), 0) != 0) {
      if (errno == ENOENT) return missing("cannot remove " + shown(path));
      return Status::io_error("cannot remove " + shown(path), errno);
    }
    return Status::OK();
  }

  Status sync_dir(const std::string& dir) override {
    const char* name = dir.empty() ? "." : dir.c_str();
    const std::string named = shown(name);
    int fd = open_retrying(dir_fd_, name, O_RDONLY | O_DIRECTORY);
    if (fd < 0) return Status::io_error("cannot open directory " + named, errno);
    int rc = fsync_retrying(fd);
    int err = errno;
    ::close(fd);
    // Some file systems (several FUSE and network ones) cannot fsync a
    // directory and say EINVAL: there is nothing more to make durable there.
    if (rc != 0 && err != EINVAL) {
      return Status::io_error("cannot fsync directory " + named, err);
    }
    if (rc != 0) {
      static std::once_flag warned;
      std::call_once(warned, [&] {
        spdlog::warn("the file system of {} cannot fsync directories: a rename there survives a "
                     "power loss only as far as the file system guarantees it",
                     named);
      });
    }
    return Status::OK();
  }

  Status create_dirs(const std::string& dir) override {
    if (dir_fd_ != AT_FDCWD && (dir.empty() || dir.front() != '/')) {
      // Only folders that exist already, beneath a folder descriptor.
      struct stat st {};
      if (::fstatat(dir_fd_, dir.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode)) {
        return Status::OK();
      }
      return Status::io_error("cannot create directory " + dir + " beneath a folder", ENOTSUP);
    }
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec) return Status::io_error("cannot create directory " + dir, ec.value());
    return Status::OK();
  }

  bool exists(const std::string& path) override {
    struct stat st;
    return ::fstatat(dir_fd_, path.c_str(), &st, exists_flags_) == 0;
  }

  // Links are not followed to read a file or to see whether one exists.
  void follow_no_links() {
    read_flags_ = O_NOFOLLOW;
    exists_flags_ = AT_SYMLINK_NOFOLLOW;
  }

 private:
  // How a path is named in messages: relative ones inside shown_in_.
  std::string shown(const std::string& path) const {
    if (shown_in_.empty() || (!path.empty() && path.front() == '/')) return path;
    return path == "." ? shown_in_ : shown_in_ + "/" + path;
  }

  const int dir_fd_;
  const mode_t file_mode_;
  const std::string shown_in_;
  int read_flags_ = 0;
  int exists_flags_ = 0;
};

}  // namespace

std::unique_ptr<FileSystem> file_system_at(int dir_fd, mode_t file_mode,
                                           const std::string& shown_as) {
  auto fs = std::make_unique<PosixFileSystem>(dir_fd, file_mode, shown_as);
  fs->follow_no_links();
  return fs;
}

FileSystem& default_file_system() {
  // Never destroyed, so that it stays usable from other static destructors.
  static auto* fs = new PosixFileSystem;
  return *fs;
}

}  // namespace leasehold
