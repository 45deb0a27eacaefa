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
//   in: those directly in it as clients, those in its `agents/` folder as
//   agents (a key in both is both). A key's name is its file's name without
//   ".pub"; it becomes the connection's "User-Id", under which its jobs are
//   recorded, and its roles the metadata "X-Roles". The folders are read
//   again at every handshake, so adding, replacing or removing a file takes
//   effect at the next one (connections already made stay). Like ssh with
//   authorized_keys, a folder or file that group or others may write is
//   not trusted: at start-up that is an error, later its keys are skipped.
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

  // How many keys may connect as agents (`agents`) or as clients.
  size_t allowed_keys(bool agents) const;

 private:
  struct AllowedKey {
    std::string name;
    bool client = false, agent = false;
  };
  using Keys = std::map<std::string, AllowedKey>;  // by Z85 public key
  struct Answer {
    std::string status = "400", text, user_id, metadata;
  };
  // Reads every *.pub file; `strict`: a bad file or folder is an error,
  // else it is logged (once until the set changes) and skipped.
  Keys read_directory(bool strict);
  void read_folder(const std::string& folder, bool agents, bool strict, Keys& keys,
                   std::string& problems) const;
  void serve();
  Answer decide(std::vector<zmq::message_t>& request);
  Answer local_peer(const std::string& address) const;
  Answer curve_peer(const zmq::message_t& key);
  void log_refusal(const std::string& address, const std::string& why);

  std::optional<std::string> dir_;
  zmq::socket_t socket_;  // REP on inproc://zeromq.zap.01; the thread's only
  mutable std::mutex mu_;
  Keys keys_;  // GUARDED_BY(mu_)
  std::string problems_logged_;
  std::chrono::steady_clock::time_point refusal_logged_{};
  uint64_t refusals_unlogged_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// ZMTP metadata (name length, name, 4-byte big-endian value length, value)
// for a ZAP reply. Names must be at most 255 bytes.
std::string zap_metadata(const std::vector<std::pair<std::string, std::string>>& properties);

}  // namespace leasehold
