// A DEALER connection to the coordinator that sends one request at a time and
// waits for the matching reply. Used by the client, the agent and tests.
//
// Thread safety: none; use one Connection per thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <zmq.hpp>

#include "shared/curve_keys.h"
#include "shared/protocol.h"

namespace leasehold {

// A decoded message together with the bytes it points into.
class Reply {
 public:
  Reply() = default;
  Reply(AlignedBytes bytes, const proto::Envelope* env) : bytes_(std::move(bytes)), env_(env) {}
  const proto::Envelope* operator->() const { return env_; }
  const proto::Envelope& envelope() const { return *env_; }
  // Throws leasehold::Error when the reply is an Error.
  const Reply& throw_if_error() const;

 private:
  AlignedBytes bytes_;  // the envelope points into these
  const proto::Envelope* env_ = nullptr;
};

class Connection {
 public:
  // Connects at once (ZeroMQ connects lazily; nothing blocks here). With
  // `curve` and a network endpoint, as a CURVE client (shared/curve_keys.h).
  Connection(zmq::context_t& ctx, std::string endpoint, std::string sender,
             const std::optional<CurveClientKeys>& curve = std::nullopt);

  const std::string& endpoint() const { return endpoint_; }
  uint64_t next_request_id() { return ++last_request_id_; }
  // The id of the latest request sent.
  uint64_t last_request_id() const { return last_request_id_; }
  void set_session(SessionToken session) { session_ = session; }
  SessionToken session() const { return session_; }
  HeaderFields header(uint64_t request_id) const { return {request_id, sender_, session_}; }

  // Builds a request with `build` (which returns the body), sends it and waits
  // up to `timeout` for the reply carrying the same request id. Replies to
  // earlier, abandoned requests go to `on_late_reply` if set (a lease granted
  // after its request timed out must still be released), else are skipped.
  // Messages that are not replies (request id 0: a Shutdown notice, a pushed
  // job) are passed to `on_notice` if set.
  // Throws Error{Timeout} naming the endpoint when no reply arrives in time,
  // Error{PermissionDenied} when the coordinator refused this program's
  // CURVE key or the ipc socket's file mode keeps it out.
  using BodyBuilder =
      std::function<std::pair<proto::Body, flatbuffers::Offset<void>>(flatbuffers::FlatBufferBuilder&)>;
  Reply request(const BodyBuilder& build, std::chrono::milliseconds timeout);

  // Receives one message within `timeout`; nullopt on timeout. Malformed
  // messages are logged and dropped. A signal interrupting the wait does
  // not end it. Throws Error{PermissionDenied} when the coordinator refused
  // the CURVE handshake, Error{Interrupted} once `interrupt` is set.
  std::optional<Reply> receive(std::chrono::milliseconds timeout);

  std::function<void(const Reply&)> on_notice;
  std::function<void(const Reply&)> on_late_reply;
  // When set, a request or receive gives up within about 100 ms of this
  // turning true (the process is stopping: SIGTERM), with Error{Interrupted}.
  const std::atomic<bool>* interrupt = nullptr;

 private:
  // Throws when the monitor reported a refused or failed CURVE handshake.
  void check_handshake();

  zmq::socket_t socket_;
  // With CURVE: a PAIR socket receiving the data socket's monitor events,
  // which alone tell a refused key from a coordinator that is not there.
  std::optional<zmq::socket_t> monitor_;
  std::string own_public_key_;
  std::string handshake_note_;  // appended to a timeout's message
  std::string endpoint_;
  std::string sender_;
  SessionToken session_;
  uint64_t last_request_id_ = 0;
};

// Text for an error when the coordinator does not answer: says whether the
// ipc socket file exists at all.
std::string unreachable_message(const std::string& endpoint, std::chrono::milliseconds waited);

// For an ipc:// endpoint whose socket file this process may not connect to
// (connecting needs write permission on it and search permission on its
// folders): why, naming the file's mode, owner and group. nullopt when it
// may, or the file is not there, or `endpoint` is not ipc://.
std::optional<std::string> ipc_permission_problem(const std::string& endpoint);

}  // namespace leasehold
