#include "coordinator/socket_files.h"

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
      throw std::runtime_error("cannot set the mode or group of the socket folder " +
                               dir.string() + ": " + std::strerror(errno));
    }
  }
  if (!std::filesystem::is_directory(dir)) {
    throw std::runtime_error("cannot create the socket folder " + dir.string() + ": " +
                             (ec ? ec.message() : "not a directory"));
  }
}

void restrict_socket_file(std::string_view endpoint, const SocketAccess& access) {
  auto path = ipc_path(endpoint);
  if (!path) return;
  if (::chmod(path->c_str(), access.mode) != 0) {
    throw std::runtime_error("cannot set the mode of socket " + *path + ": " +
                             std::strerror(errno));
  }
  if (access.group != static_cast<gid_t>(-1) &&
      ::chown(path->c_str(), static_cast<uid_t>(-1), access.group) != 0) {
    throw std::runtime_error("cannot give socket " + *path + " its socket_group: " +
                             std::strerror(errno) +
                             " (the coordinator's user must be a member of that group)");
  }
}

}  // namespace leasehold
