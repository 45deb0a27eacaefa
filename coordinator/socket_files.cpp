#include "coordinator/socket_files.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <vector>

#include "shared/endpoint.h"

namespace leasehold {

SocketAccess socket_access(uint32_t mode, const std::string& group) {
  SocketAccess a;
  a.mode = static_cast<mode_t>(mode);
  if (group.empty()) return a;
  std::vector<char> buf(16384);
  struct group g {};
  struct group* found = nullptr;
  if (getgrnam_r(group.c_str(), &g, buf.data(), buf.size(), &found) != 0 || !found) {
    throw std::invalid_argument("socket_group '" + group + "' is not a group on this host");
  }
  a.group = found->gr_gid;
  return a;
}

bool owned_by_us_or_root(const struct stat& st) {
  return st.st_uid == 0 || st.st_uid == ::geteuid();
}

void prepare_socket_directory(std::string_view endpoint, const SocketAccess& access) {
  auto path = ipc_path(endpoint);
  if (!path) return;
  const std::filesystem::path dir = std::filesystem::path(*path).parent_path();
  if (dir.empty()) return;
  std::error_code ec;
  if (std::filesystem::create_directories(dir, ec)) {
    mode_t mode = 0700;
    if (access.mode & 0070) mode |= 0050;
    if (access.mode & 0007) mode |= 0005;
    if (::chmod(dir.c_str(), mode) != 0 ||
        (access.group != static_cast<gid_t>(-1) &&
         ::chown(dir.c_str(), static_cast<uid_t>(-1), access.group) != 0)) {
      throw std::runtime_error("cannot set the mode or group of the socket folder " + dir.string() +
                               ": " + std::strerror(errno));
    }
  }
  if (!std::filesystem::is_directory(dir)) {
    throw std::runtime_error("cannot create the socket folder " + dir.string() + ": " +
                             (ec ? ec.message() : "not a directory"));
  }
  // Whoever may remove or rename entries in the folder may put their own
  // socket in ours' place (libzmq removes the path before it binds, too);
  // whoever owns a link to it may point it elsewhere.
  struct stat link {
  }, st{};
  if (::lstat(dir.c_str(), &link) != 0 || ::stat(dir.c_str(), &st) != 0) {
    throw std::runtime_error("cannot examine the socket folder " + dir.string() + ": " +
                             std::strerror(errno));
  }
  for (const struct stat* s : {&link, &st}) {
    if (!owned_by_us_or_root(*s)) {
      throw std::runtime_error("the socket folder " + dir.string() +
                               (s == &link && S_ISLNK(link.st_mode) ? " is a link that" : "") +
                               " belongs to uid " + std::to_string(s->st_uid) +
                               ", who could replace the socket: use a folder of this user's or "
                               "root's");
    }
  }
  if ((st.st_mode & (S_IWOTH | S_IWGRP)) && !(st.st_mode & S_ISVTX)) {
    throw std::runtime_error("the socket folder " + dir.string() + " may be written by " +
                             (st.st_mode & S_IWOTH ? "anyone" : "its group") +
                             " and is not sticky, so they could replace the socket: use a "
                             "folder only this user may write");
  }
}

void bind_socket(zmq::socket_t& socket, const std::string& endpoint, const SocketAccess& access,
                 const std::string& what) {
  auto path = ipc_path(endpoint);
  // The umask is the process's: narrowed only for the moment of bind, when
  // no other thread of the coordinator creates files yet (the store writer
  // may, and then its files are only narrower).
  const mode_t before = path ? ::umask(0177) : 0;
  try {
    socket.bind(endpoint);
  } catch (const zmq::error_t& e) {
    if (path) ::umask(before);
    throw std::runtime_error("cannot bind " + what + endpoint + ": " + e.what());
  }
  if (!path) return;
  ::umask(before);
  secure_socket_file(*path, access);
}

void secure_socket_file(const std::string& path, const SocketAccess& access) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0 || !S_ISSOCK(st.st_mode) || st.st_uid != ::geteuid()) {
    throw std::runtime_error("socket " + path + " is not a socket this process owns after bind");
  }
  if (::fchmodat(AT_FDCWD, path.c_str(), access.mode, AT_SYMLINK_NOFOLLOW) != 0) {
    throw std::runtime_error("cannot set the mode of socket " + path + ": " +
                             std::strerror(errno));
  }
  if (access.group != static_cast<gid_t>(-1) &&
      ::lchown(path.c_str(), static_cast<uid_t>(-1), access.group) != 0) {
    throw std::runtime_error("cannot give socket " + path +
                             " its socket_group: " + std::strerror(errno) +
                             " (the coordinator's user must be a member of that group)");
  }
}

}  // namespace leasehold
