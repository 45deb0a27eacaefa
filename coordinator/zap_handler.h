// The coordinator's ZAP handler (ZeroMQ RFC 27): libzmq asks it about every
// new connection to the ROUTER socket, on a thread of its own, so nothing
// it does can stall the poll loop.
//
// - ipc:// (the NULL mechanism): the kernel's credentials of the peer
//   (SO_PEERCRED, in the request's address) are looked up once per
//   connection here: the user's name and groups, which may take a while
//   with NSS on LDAP. They become the connection's metadata ("X-User",
//   "X-Groups"), which every message then carries to the loop
//   (coordinator/peer.h). Who may connect at all is up to the socket file's
//   mode (coordinator/socket_files.h); what they may do, to the groups
//   (coordinator/access.h).
// - tcp:// (CURVE): only the public keys in the allowed-keys directory
//   (curve_allowed_keys: `*.pub` files written by `leasehold keygen`) get
//   in. A key's name is its file's name without ".pub", and becomes the
//   connection's "User-Id", under which its jobs are recorded. Adding or
//   removing a file takes effect at the next handshake; connections already
//   made stay.
//
// Thread safety: the handler answers on its own thread; the public methods
// may be called from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

namespace leasehold {

class ZapHandler {
 public:
  // The ZAP domain the ROUTER socket sets so that its ipc:// connections
  // (NULL mechanism) are asked about too.
  static constexpr const char* kDomain = "leasehold";

  // Binds the ZAP endpoint in `ctx` (before any socket that uses it binds)
  // and reads the allowed-keys directory if there is one (nullopt: no
  // CURVE key is allowed). Throws std::runtime_error naming the directory
  // or the file that cannot be read.
  ZapHandler(zmq::context_t& ctx, std::optional<std::string> allowed_dir);
  ~ZapHandler();
  ZapHandler(const ZapHandler&) = delete;
  ZapHandler& operator=(const ZapHandler&) = delete;

  size_t allowed_keys() const;

 private:
  using Keys = std::map<std::string, std::string>;  // Z85 public key -> name
  struct Answer {
    std::string status = "400", text, user_id, metadata;
  };
  // Reads every *.pub file; `strict`: a bad file is an error, else it is
  // logged and skipped.
  Keys read_directory(bool strict) const;
  void reload_if_changed();
  void serve();
  Answer decide(std::vector<zmq::message_t>& request);
  Answer local_peer(const std::string& address) const;
  Answer curve_peer(const zmq::message_t& key);
  void log_refusal(const std::string& address, const std::string& why);

  std::optional<std::string> dir_;
  zmq::socket_t socket_;  // REP on inproc://zeromq.zap.01; the thread's only
  mutable std::mutex mu_;
  Keys keys_;  // GUARDED_BY(mu_)
  int64_t dir_mtime_ns_ = 0;
  std::chrono::steady_clock::time_point refusal_logged_{};
  uint64_t refusals_unlogged_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// ZMTP metadata (name length, name, 4-byte big-endian value length, value)
// for a ZAP reply. Names must be at most 255 bytes.
std::string zap_metadata(const std::vector<std::pair<std::string, std::string>>& properties);

}  // namespace leasehold
