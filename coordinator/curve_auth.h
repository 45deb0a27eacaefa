// The coordinator's ZAP handler (ZeroMQ RFC 27): decides which CURVE public
// keys may connect to its network endpoints. The allowed keys are the
// `*.pub` files of one directory (curve_allowed_keys, written by `leasehold
// keygen`); a key's name is its file's name without ".pub", and it becomes
// the connection's "User-Id" (coordinator/peer.h), under which jobs are
// recorded as submitted. Adding or removing a file takes effect at the next
// handshake; connections already made stay.
//
// ipc:// connections use the NULL mechanism and are not asked about here
// (their sockets set no ZAP domain); the kernel's credentials decide there.
//
// Thread safety: the handler answers on a thread of its own; the public
// methods may be called from any thread.
#pragma once

#include <atomic>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <zmq.hpp>

namespace leasehold {

class CurveAuthenticator {
 public:
  // Reads the directory and binds the ZAP endpoint in `ctx` (before any
  // CURVE server socket binds). Throws std::runtime_error naming the
  // directory or the file that cannot be read.
  CurveAuthenticator(zmq::context_t& ctx, std::string allowed_dir);
  ~CurveAuthenticator();
  CurveAuthenticator(const CurveAuthenticator&) = delete;
  CurveAuthenticator& operator=(const CurveAuthenticator&) = delete;

  size_t allowed_keys() const;
  uint64_t refused() const { return refused_.load(); }

 private:
  using Keys = std::map<std::string, std::string>;  // Z85 public key -> name
  // Reads every *.pub file; `strict`: a bad file is an error, else it is
  // logged and skipped.
  Keys read_directory(bool strict) const;
  void reload_if_changed();
  void serve();
  void answer(std::vector<zmq::message_t>& request);

  std::string dir_;
  zmq::socket_t socket_;  // REP on inproc://zeromq.zap.01; the thread's only
  mutable std::mutex mu_;
  Keys keys_;  // GUARDED_BY(mu_)
  int64_t dir_mtime_ns_ = 0;
  std::atomic<uint64_t> refused_{0};
  std::chrono::steady_clock::time_point refusal_logged_{};
  uint64_t refusals_unlogged_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace leasehold
