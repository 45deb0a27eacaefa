// The side channel that hands a session the memory it was granted: an
// AF_UNIX SOCK_SEQPACKET socket beside the coordinator's endpoint, over
// which the coordinator sends the file descriptors of a lease's or a
// region's chunks (SCM_RIGHTS) to the process that asks, and to nobody
// else. The ZeroMQ protocol grants (offsets, sizes); this channel delivers.
//
// A request names the agent and its session token (the secret RegisterAck
// gave it) and one lease id or region name. The coordinator answers when
// that session holds the lease or is attached to the region and, where it
// knows the agent's process (ipc://), the kernel says the asking process
// is that one (SO_PEERCRED). The answer is one or more datagrams: the
// grant's chunk range and access, and up to kBatch descriptors each.
//
// Why not pidfd_getfd (the agent takes the descriptors from the
// coordinator): the right it needs, to trace the coordinator, would give
// it every chunk of the pool.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "shared/device.h"
#include "shared/session_token.h"
#include "shared/unique_fd.h"

namespace leasehold {

struct ChunkRequest {
  enum class Kind : uint8_t { Lease = 1, Region = 2 };
  Kind kind = Kind::Lease;
  std::string agent;  // 1..128 bytes
  SessionToken session;
  uint64_t lease_id = 0;   // Lease
  std::string region;      // Region: its name, 1..128 bytes
  uint64_t from_chunk = 0; // only chunks from this pool index on (a lease grown in place)
};

// What the coordinator grants: chunks [first, first + count) of the pool of
// `device` (its ordinal), to be mapped with `access`.
struct ChunkGrant {
  int device = 0;
  uint64_t first = 0;
  uint64_t count = 0;
  Access access = Access::ReadWrite;
};

inline constexpr size_t kChunkBatch = 128;  // descriptors per datagram (SCM_MAX_FD is 253)
// Descriptors per answer: its datagrams fit a socket's send buffer while the
// asker maps the previous ones; a larger grant takes several answers.
inline constexpr size_t kAnswerChunks = 32 * kChunkBatch;

// Coordinator side. Single-threaded: the broker's loop polls listen_fd()
// and connections() and calls accept_pending() and serve().
class ChunkServer {
 public:
  // The decision: a grant, or why not (sent to the asker). `peer_pid` and
  // `peer_uid`: the asking process as the kernel names it.
  struct Decision {
    std::optional<ChunkGrant> grant;
    const DevicePool* pool = nullptr;  // the grant's pool
    std::string refusal;
  };
  using Decide = std::function<Decision(const ChunkRequest&, pid_t peer_pid, uid_t peer_uid)>;

  // Listens at `path` (a stale socket file there is replaced; the caller
  // holds the state folder's lock, so it is no live coordinator's).
  // `secure(path)` gives the file its mode and group before anyone can
  // connect. Throws std::runtime_error naming the path.
  ChunkServer(std::string path, const std::function<void(const std::string&)>& secure,
              Decide decide);
  ~ChunkServer();  // removes the socket file
  ChunkServer(const ChunkServer&) = delete;
  ChunkServer& operator=(const ChunkServer&) = delete;

  const std::string& path() const { return path_; }
  int listen_fd() const { return listen_.get(); }
  std::vector<int> connections() const;
  // Accepts every pending connection: up to kMaxConnections at once, and
  // kMaxConnectionsPerUser of one user (one per agent and per program
  // process is the use; more is someone hoarding them).
  void accept_pending();
  // False for a moment after the process ran out of descriptors: poll
  // listen_fd() only when this holds.
  bool accepting() const;
  // Reads and answers what connection `fd` sent; closes it when its peer
  // left, sent something malformed, or does not take its answer.
  void serve(int fd);

  static constexpr size_t kMaxConnections = 1024;
  static constexpr size_t kMaxConnectionsPerUser = 256;
  uint64_t served() const { return served_; }
  uint64_t refused() const { return refused_; }

 private:
  struct Peer {
    UniqueFd fd;
    pid_t pid = 0;
    uid_t uid = 0;
  };
  void drop(int fd, const std::string& why);
  bool answer(Peer& peer, const ChunkRequest& req);

  std::string path_;
  UniqueFd listen_;
  Decide decide_;
  std::vector<Peer> peers_;
  std::chrono::steady_clock::time_point accept_paused_until_{};
  uint64_t served_ = 0, refused_ = 0;
};

// Agent side: one connection, made on first use and again after the
// coordinator dropped it. Thread-safe.
class ChunkClient {
 public:
  explicit ChunkClient(std::string path) : path_(std::move(path)) {}
  const std::string& path() const { return path_; }
  // Asks for `req`'s chunks; `take(first, fds)` gets them batch by batch
  // (first: the pool index of fds[0]). Returns the grant. Throws
  // std::runtime_error with the coordinator's refusal or what broke.
  ChunkGrant fetch(const ChunkRequest& req,
                   const std::function<void(uint64_t first, std::vector<UniqueFd> fds,
                                            const ChunkGrant& grant)>& take);

 private:
  void connect_locked();
  void send_locked(const void* bytes, size_t size);
  std::string path_;
  std::mutex mu_;
  UniqueFd fd_;
};

// The channel's socket path for a coordinator endpoint: the ipc:// file's
// path with ".chunks" appended, or STATE_DIR/chunks.sock for other
// transports. Throws std::invalid_argument when it would be longer than a
// Unix socket path may be.
std::string chunk_socket_path(const std::string& endpoint, const std::string& state_dir);

}  // namespace leasehold
