// Who may connect to the coordinator's ipc:// sockets, as file modes: a
// process connects to a Unix socket only with write permission on its file
// and search permission on every folder above it. The coordinator gives its
// socket files socket_mode (0660) and socket_group, and a socket folder it
// creates the matching search mode (0750); the kernel's credentials then
// decide the rest (coordinator/access.h).
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <string>
#include <string_view>
#include <zmq.hpp>

namespace leasehold {

struct SocketAccess {
  mode_t mode = 0660;
  gid_t group = static_cast<gid_t>(-1);  // -1: leave as created
};

// Resolves socket_group (empty: none). Throws std::invalid_argument naming
// a group that does not exist.
SocketAccess socket_access(uint32_t mode, const std::string& group);

// Whether a file or folder is this process's user's or root's: the only
// owners trusted with what the coordinator binds or reads its keys from.
bool owned_by_us_or_root(const struct stat& st);

// Creates the folder of an ipc:// endpoint when missing: owner rwx, and
// r-x for group and others where `access.mode` gives them any permission,
// owned by its group. An existing folder (or a link to one) that another
// user (not root) owns, or that group or others may write without the
// sticky bit, is refused: they could replace the socket. No-op for other transports. Throws
// std::runtime_error naming the folder.
void prepare_socket_directory(std::string_view endpoint, const SocketAccess& access);

// Binds `socket` to `endpoint`; for ipc:// the socket file is created with
// no permission for group and others (the process umask is narrowed around
// bind, so no connection sneaks in before) and then given `access`: it
// must be a socket this process owns (lstat; neither follows a link).
// Throws std::runtime_error naming `what` and the endpoint.
void bind_socket(zmq::socket_t& socket, const std::string& endpoint, const SocketAccess& access,
                 const std::string& what);

// Gives the socket file at `path`, just bound by this process with no
// permission for others, `access`. Throws std::runtime_error naming it.
void secure_socket_file(const std::string& path, const SocketAccess& access);

}  // namespace leasehold
