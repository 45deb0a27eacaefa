#include "shared/checkpoint_folder.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <system_error>
#include <vector>

#include "shared/printable.h"

namespace leasehold {
namespace {

// Folders that hold the system itself: refused, and everything in them.
constexpr const char* kSystemTrees[] = {"/bin",   "/boot",   "/dev",  "/etc",  "/lib",
                                        "/lib32", "/lib64",  "/libx32", "/proc", "/run",
                                        "/sbin",  "/sys",    "/usr"};
// Shared folders refused themselves (a user's folder inside them is fine).
constexpr const char* kSharedFolders[] = {"/",    "/home",    "/root",    "/tmp", "/var",
                                          "/var/lib", "/var/tmp", "/opt", "/srv", "/mnt",
                                          "/media"};

bool at_or_under(const std::string& path, const std::string& tree) {
  return path == tree || (path.size() > tree.size() && path.compare(0, tree.size(), tree) == 0 &&
                          path[tree.size()] == '/');
}

// The components of an absolute path, or why it is not a plain one.
std::vector<std::string> components(const std::string& dir) {
  if (dir.empty() || dir.front() != '/') {
    throw std::runtime_error(printable(dir) + " is not an absolute path");
  }
  std::vector<std::string> parts;
  size_t i = 1;
  while (i <= dir.size()) {
    size_t j = dir.find('/', i);
    if (j == std::string::npos) j = dir.size();
    std::string part = dir.substr(i, j - i);
    if (part == "." || part == ".." || (part.empty() && dir != "/")) {
      throw std::runtime_error(printable(dir) +
                               " is not a plain path (it has '.', '..', '//' or a trailing '/')");
    }
    if (!part.empty()) parts.push_back(std::move(part));
    i = j + 1;
  }
  return parts;
}

int open_at(int dir_fd, const std::string& name, int flags) {
  int fd;
  do {
    fd = ::openat(dir_fd, name.c_str(), flags | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// Opens the folder `dir` walking its components without following links
// (the last one readable, for fsync; the others only searched). With
// `create`, missing components are made with mode 0700. Throws
// std::system_error (ENOENT) when it is missing, std::runtime_error for a
// link or any other failure, naming the component.
int open_folder(const std::string& dir, bool create) {
  const std::vector<std::string> parts = components(dir);
  int fd = open_at(AT_FDCWD, "/", O_PATH | O_DIRECTORY);
  if (fd < 0) throw std::system_error(errno, std::generic_category(), "cannot open /");
  std::string walked;
  for (size_t i = 0; i < parts.size(); ++i) {
    walked += "/" + parts[i];
    const bool last = i + 1 == parts.size();
    const int flags = (last ? O_RDONLY : O_PATH) | O_DIRECTORY | O_NOFOLLOW;
    int next = open_at(fd, parts[i], flags);
    if (next < 0 && errno == ENOENT && create) {
      if (::mkdirat(fd, parts[i].c_str(), 0700) != 0 && errno != EEXIST) {
        const int err = errno;
        ::close(fd);
        throw std::runtime_error("cannot create " + printable(walked) + ": " +
                                 std::strerror(err));
      }
      next = open_at(fd, parts[i], flags);
    }
    if (next < 0) {
      const int err = errno;
      struct stat st {};
      const bool link =
          ::fstatat(fd, parts[i].c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode);
      ::close(fd);
      if (link) {
        throw std::runtime_error(printable(walked) +
                                 " is a symbolic link: checkpoint folders are reached through "
                                 "none (name the real folder)");
      }
      if (err == ENOENT) {
        throw std::system_error(ENOENT, std::generic_category(), printable(walked));
      }
      if (err == ENOTDIR) throw std::runtime_error(printable(walked) + " is not a folder");
      throw std::runtime_error("cannot open " + printable(walked) + ": " + std::strerror(err));
    }
    ::close(fd);
    fd = next;
  }
  return fd;
}

// Why the open folder `fd` may not be used for `owner`'s checkpoints.
std::optional<std::string> owner_refusal(int fd, const std::string& dir,
                                         const CheckpointOwner& owner) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return "cannot stat " + printable(dir) + ": " + std::strerror(errno);
  if (!S_ISDIR(st.st_mode)) return printable(dir) + " is not a folder";
  if (owner.private_folder) {
    if (st.st_uid != ::geteuid()) {
      return "the job's private folder " + printable(dir) + " belongs to uid " +
             std::to_string(st.st_uid) + ", not this agent's uid " + std::to_string(::geteuid());
    }
    if (st.st_mode & 077) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      return "the job's private folder " + printable(dir) + " has mode " + mode +
             ": others may reach it (it must be 0700)";
    }
    return std::nullopt;
  }
  if (owner.uid < 0) {
    return "the submitter's user is not known (a network client), so no folder of theirs can "
           "be checked: leave checkpoint.directory out for a folder of the job's own";
  }
  if (static_cast<int64_t>(st.st_uid) != owner.uid) {
    return printable(dir) + " belongs to uid " + std::to_string(st.st_uid) +
           ", not to the job's submitter (uid " + std::to_string(owner.uid) +
           "): checkpoints go only where their owner could write them";
  }
  return std::nullopt;
}

std::optional<std::string> system_folder_refusal(const std::string& dir) {
  for (const char* tree : kSystemTrees) {
    if (at_or_under(dir, tree)) return printable(dir) + " is a system folder";
  }
  for (const char* folder : kSharedFolders) {
    if (dir == folder) {
      return printable(dir) + " is a shared system folder: name a folder of your own in it";
    }
  }
  return std::nullopt;
}

}  // namespace

CheckpointOwner CheckpointOwner::this_user() { return {false, static_cast<int64_t>(::geteuid())}; }

std::optional<std::string> checkpoint_folder_refusal(const std::string& dir, int64_t uid) {
  try {
    components(dir);
  } catch (const std::exception& e) {
    return e.what();
  }
  if (auto no = system_folder_refusal(dir)) return no;
  int fd;
  try {
    fd = open_folder(dir, false);
  } catch (const std::system_error& e) {
    if (e.code().value() == ENOENT) {
      return printable(dir) + " does not exist: create it first (it must belong to you)";
    }
    return e.what();
  } catch (const std::exception& e) {
    return e.what();
  }
  auto no = owner_refusal(fd, dir, CheckpointOwner{false, uid});
  ::close(fd);
  return no;
}

CheckpointFolder::CheckpointFolder(const std::string& dir, const CheckpointOwner& owner,
                                   bool create)
    : dir_(dir) {
  if (auto no = system_folder_refusal(dir)) throw std::runtime_error(*no);
  fd_ = open_folder(dir, create && owner.private_folder);
  if (auto no = owner_refusal(fd_, dir, owner)) {
    ::close(fd_);
    fd_ = -1;
    throw std::runtime_error(*no);
  }
  files_ = file_system_at(fd_, 0600, dir_);
}

CheckpointFolder::~CheckpointFolder() {
  files_.reset();
  if (fd_ >= 0) ::close(fd_);
}

std::optional<std::string> CheckpointFolder::name_of(const std::string& path) const {
  if (path.size() <= dir_.size() + 1 || path.compare(0, dir_.size(), dir_) != 0 ||
      path[dir_.size()] != '/') {
    return std::nullopt;
  }
  std::string name = path.substr(dir_.size() + 1);
  if (name.find('/') != std::string::npos || name == "." || name == "..") return std::nullopt;
  return name;
}

Status CheckpointFolder::outside(const std::string& path) const {
  return Status::invalid_argument(printable(path) + " is not a file directly inside the checkpoint folder " +
                                  printable(dir_));
}

Status CheckpointFolder::new_writable_file(const std::string& path,
                                           std::unique_ptr<WritableFile>* out) {
  auto name = name_of(path);
  if (!name) return outside(path);
  return files_->new_writable_file(*name, out);
}

Status CheckpointFolder::read_file(const std::string& path, std::string* contents,
                                   size_t max_bytes) {
  auto name = name_of(path);
  if (!name) return outside(path);
  return files_->read_file(*name, contents, max_bytes);
}

Status CheckpointFolder::read_range(const std::string& name, uint64_t offset, size_t max_bytes,
                                    std::string* out, uint64_t* total, uint64_t* version) {
  if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..") {
    return outside(name);
  }
  int fd;
  do {
    fd = ::openat(fd_, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) return Status::io_error("cannot open " + dir_ + "/" + name, errno);
  struct stat st {};
  Status result = Status::OK();
  if (::fstat(fd, &st) != 0) {
    result = Status::io_error("cannot stat " + dir_ + "/" + name, errno);
  } else if (!S_ISREG(st.st_mode)) {
    result = Status::invalid_argument(dir_ + "/" + name + " is not a regular file");
  } else if (st.st_nlink != 1) {
    result = Status::invalid_argument(dir_ + "/" + name + " has " + std::to_string(st.st_nlink) +
                                      " links; a checkpoint has one");
  } else {
    *total = static_cast<uint64_t>(st.st_size);
    *version = static_cast<uint64_t>(st.st_ino) * 0x9E3779B97F4A7C15ull ^
               (static_cast<uint64_t>(st.st_ctim.tv_sec) * 1000000000ull +
                static_cast<uint64_t>(st.st_ctim.tv_nsec));
    const uint64_t want = offset >= *total ? 0 : std::min<uint64_t>(max_bytes, *total - offset);
    out->resize(want);
    size_t done = 0;
    while (done < want) {
      const ssize_t n = ::pread(fd, out->data() + done, want - done, static_cast<off_t>(offset + done));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        result = n == 0 ? Status::io_error(dir_ + "/" + name + " shrank while read", EIO)
                        : Status::io_error("cannot read " + dir_ + "/" + name, errno);
        break;
      }
      done += static_cast<size_t>(n);
    }
  }
  ::close(fd);
  return result;
}

Status CheckpointFolder::rename(const std::string& from, const std::string& to) {
  auto a = name_of(from), b = name_of(to);
  if (!a) return outside(from);
  if (!b) return outside(to);
  return files_->rename(*a, *b);
}

Status CheckpointFolder::remove(const std::string& path) {
  auto name = name_of(path);
  if (!name) return outside(path);
  return files_->remove(*name);
}

Status CheckpointFolder::sync_dir(const std::string& dir) {
  if (dir != dir_) return outside(dir);
  return files_->sync_dir(".");
}

Status CheckpointFolder::create_dirs(const std::string& dir) {
  // The folder was opened (or created) already.
  if (dir != dir_) return outside(dir);
  return Status::OK();
}

bool CheckpointFolder::exists(const std::string& path) {
  auto name = name_of(path);
  return name && files_->exists(*name);
}

}  // namespace leasehold
