#include "shared/connection.h"

#include <fcntl.h>
#include <grp.h>
#include <pwd.h>
#include <spdlog/spdlog.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <filesystem>
#include <cstring>
#include <thread>

#include "shared/endpoint.h"

namespace leasehold {

const Reply& Reply::throw_if_error() const {
  if (env_->body_type() == proto::Body::Error) {
    const auto* e = env_->body_as_Error();
    throw Error(e->code(), std::string(str(e->message())));
  }
  return *this;
}

Connection::Connection(zmq::context_t& ctx, std::string endpoint, std::string sender,
                       const std::optional<CurveClientKeys>& curve)
    : socket_(ctx, zmq::socket_type::dealer), endpoint_(std::move(endpoint)),
      sender_(std::move(sender)) {
  socket_.set(zmq::sockopt::linger, 0);
  // Keys are for network endpoints; an ipc:// one is not a CURVE server.
  if (curve && needs_curve(endpoint_)) {
    apply_curve_client(socket_, *curve);
    own_public_key_ = curve->own.public_key;
    // The monitor is connected before the socket so that no event is lost.
    static std::atomic<uint64_t> monitors{0};
    const std::string address = "inproc://leasehold-connection-monitor-" +
                                std::to_string(::getpid()) + "-" + std::to_string(++monitors);
    if (zmq_socket_monitor(socket_.handle(), address.c_str(),
                           ZMQ_EVENT_HANDSHAKE_FAILED_AUTH | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                               ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) != 0) {
      throw Error(ErrorCode::Internal,
                  std::string("cannot monitor the connection: ") + zmq_strerror(zmq_errno()));
    }
    monitor_.emplace(ctx, zmq::socket_type::pair);
    monitor_->set(zmq::sockopt::linger, 0);
    monitor_->connect(address);
  }
  // Do not queue requests for a coordinator that is not there: fail fast
  // instead of delivering stale requests when it comes back.
  socket_.set(zmq::sockopt::immediate, 1);
  socket_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxMessageBytes));
  socket_.connect(endpoint_);
}

std::optional<Reply> Connection::receive(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    // Round the wait up, and once the deadline has passed poll one last time
    // without waiting: truncating to whole milliseconds would spin for up
    // to a millisecond at the end (and a zero timeout would always spin).
    if (interrupt && interrupt->load()) {
      throw Error(ErrorCode::Interrupted,
                  "gave up waiting for " + endpoint_ + ": this process is stopping");
    }
    auto now = std::chrono::steady_clock::now();
    bool last = now >= deadline;
    auto wait = last ? std::chrono::milliseconds(0)
                     : std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
    if (interrupt) wait = std::min(wait, std::chrono::milliseconds(100));
    zmq::pollitem_t items[] = {{socket_.handle(), 0, ZMQ_POLLIN, 0},
                               {monitor_ ? monitor_->handle() : nullptr, 0, ZMQ_POLLIN, 0}};
    try {
      zmq::poll(items, monitor_ ? 2 : 1, wait);
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;
      continue;  // a signal (SIGTERM sets the stop flag): look again
    }
    if (items[1].revents & ZMQ_POLLIN) check_handshake();
    zmq::message_t msg;
    if (!(items[0].revents & ZMQ_POLLIN) || !socket_.recv(msg, zmq::recv_flags::dontwait)) {
      if (last) return std::nullopt;
      continue;
    }
    AlignedBytes bytes(msg);
    auto decoded = decode(bytes.bytes());
    if (auto* err = std::get_if<DecodeError>(&decoded)) {
      spdlog::warn("dropping a malformed message from {}: {}", endpoint_, err->message);
      continue;
    }
    const proto::Envelope* env = std::get<const proto::Envelope*>(decoded);
    return Reply(std::move(bytes), env);
  }
}

Reply Connection::request(const BodyBuilder& build, std::chrono::milliseconds timeout) {
  flatbuffers::FlatBufferBuilder fbb(512);
  uint64_t id = next_request_id();
  auto [type, body] = build(fbb);
  finish_envelope(fbb, header(id), type, body);
  // The coordinator's socket drops a larger message with the connection,
  // silently: the sender would only see its timeout.
  if (fbb.GetSize() > kMaxMessageBytes) {
    throw Error(ErrorCode::InvalidArgument,
                std::string(proto::EnumNameBody(type)) + " message of " +
                    std::to_string(fbb.GetSize()) + " bytes exceeds the protocol's limit of " +
                    std::to_string(kMaxMessageBytes) + " bytes; nothing was sent");
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  // With ZMQ_IMMEDIATE a send fails with EAGAIN while no connection is up;
  // retry until the deadline so a coordinator that is starting gets a chance
  // (but not when the socket file's mode or the coordinator's CURVE check
  // keeps this process out: waiting would not change that).
  bool permissions_checked = false;
  handshake_note_.clear();
  while (!socket_.send(to_message(fbb), zmq::send_flags::dontwait)) {
    if (!permissions_checked) {
      permissions_checked = true;
      if (auto why = ipc_permission_problem(endpoint_)) throw Error(ErrorCode::PermissionDenied, *why);
    }
    if (monitor_) check_handshake();
    if (interrupt && interrupt->load()) {
      throw Error(ErrorCode::Interrupted,
                  "gave up sending to " + endpoint_ + ": this process is stopping");
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error(ErrorCode::Timeout, unreachable_message(endpoint_, timeout) + handshake_note_);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    auto reply = receive(std::max(left, std::chrono::milliseconds(0)));
    if (!reply) {
      throw Error(ErrorCode::Timeout, unreachable_message(endpoint_, timeout) + handshake_note_);
    }
    uint64_t rid = (*reply)->header()->request_id();
    if (rid == id) return std::move(*reply);
    if (rid == 0) {
      if (on_notice) on_notice(*reply);
    } else if (on_late_reply) {
      on_late_reply(*reply);
    } else {
      spdlog::debug("skipping a late reply to request {} (waiting for {})", rid, id);
    }
  }
}

void Connection::check_handshake() {
  while (true) {
    zmq::message_t event, address;
    if (!monitor_->recv(event, zmq::recv_flags::dontwait)) return;
    if (event.more()) (void)monitor_->recv(address, zmq::recv_flags::none);
    if (event.size() < 6) continue;
    uint16_t id;
    uint32_t value;
    std::memcpy(&id, event.data(), sizeof id);
    std::memcpy(&value, static_cast<const char*>(event.data()) + 2, sizeof value);
    if (id == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) {
      throw Error(ErrorCode::PermissionDenied,
                  "the coordinator at " + endpoint_ + " refused this program's CURVE key " +
                      own_public_key_ + " (ZAP status " + std::to_string(value) +
                      "): put its .pub file in the coordinator's curve_allowed_keys directory");
    }
    // A wrong server key shows as a handshake that fails without detail,
    // retried: not final (the coordinator may be restarting), so it only
    // explains a timeout.
    handshake_note_ = " (the CURVE handshake failed: is the server key the coordinator's public key?)";
  }
}

std::string unreachable_message(const std::string& endpoint, std::chrono::milliseconds waited) {
  std::string msg = "no reply from the coordinator at " + endpoint + " within " +
                    std::to_string(waited.count()) + " ms";
  if (auto path = ipc_path(endpoint); path && !std::filesystem::exists(*path)) {
    msg += " (socket " + *path + " does not exist: is leasehold-coordinator running?)";
  }
  return msg;
}

std::optional<std::string> ipc_permission_problem(const std::string& endpoint) {
  auto path = ipc_path(endpoint);
  if (!path) return std::nullopt;
  if (::faccessat(AT_FDCWD, path->c_str(), W_OK, AT_EACCESS) == 0 || errno != EACCES) {
    return std::nullopt;
  }
  std::string why = "permission denied connecting to " + *path;
  struct stat st {};
  if (::stat(path->c_str(), &st) == 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    const struct passwd* pw = ::getpwuid(st.st_uid);
    const struct group* gr = ::getgrgid(st.st_gid);
    const std::string group = gr ? gr->gr_name : std::to_string(st.st_gid);
    why += std::string(" (mode ") + mode + ", owner " + (pw ? pw->pw_name : std::to_string(st.st_uid)) +
           ", group " + group + "): the coordinator's socket admits its owner and members of group " +
           group;
  } else {
    why += ": a folder on its path may not be searched by this user";
  }
  return why;
}

}  // namespace leasehold
