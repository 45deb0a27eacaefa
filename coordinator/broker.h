// The coordinator's transport: one poll loop over the ROUTER socket, shaped
// like the ZeroMQ guide's Majordomo broker, around the transport-free core
// (coordinator/core.h). It owns everything with a file descriptor: the
// sockets, the device pool, the job store and its writer thread, the file
// workers and the lock on the state directory.
//
// Each turn: receive and decode requests and hand them to the core; hand it
// finished file checks; let it tick; then carry out what it asked for.
// Messages and events of a core call that changed stored jobs wait until the
// store writer has committed those changes (a submission is acknowledged
// only once it is durable; an assignment leaves only once it is recorded);
// everything else is sent at once.
//
// Thread safety: run() is called from one thread; the stop flag may be set
// from any thread or a signal handler.
#pragma once

#include <unistd.h>

#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>
#include <zmq.hpp>

#include "coordinator/core.h"
#include "coordinator/malformed_peers.h"
#include "coordinator/options.h"
#include "coordinator/peer.h"
#include "shared/chunk_channel.h"
#include "shared/unique_fd.h"

namespace leasehold {

class StoreWriter;
class FileWorkers;
class ChunkRenewer;
class MpsDaemon;
class HttpEndpoint;
class ZapHandler;

class Broker {
 public:
  // Locks the state directory, opens the job store, creates the pool and
  // binds the sockets. Throws std::runtime_error naming the cause (another
  // coordinator on the endpoint or the state directory, a corrupt store, a
  // pool too large, ...).
  explicit Broker(const CoordinatorOptions& opts);
  // Commits what is queued for the store (bounded wait) and frees the pool.
  ~Broker();

  // Serves until `stop` becomes true, then tells the agents and returns.
  // `tick`, if set, runs once per loop turn (at least every heartbeat/4): the
  // place for systemd's watchdog, so a hung loop stops the pings.
  void run(const std::atomic<bool>& stop, const std::function<void()>& tick = {});

  // A one-line summary for logs and systemd's STATUS=.
  std::string summary() const;

 private:
  // One frame set to send: a reply/push (to a routing id) or an event.
  struct Outgoing {
    bool event = false;
    std::string address;  // routing id, or the event's topic
    zmq::message_t body;
    // Of job `job`'s acceptance (OutMessage::job, or the job's event), and
    // whether it is the JobAccepted answering request `request_id`.
    uint64_t job = 0;
    bool accepts = false;
    uint64_t request_id = 0;
  };
  struct Held {
    uint64_t seq = 0;  // store write that must be committed first
    std::vector<Outgoing> messages;
  };

  Now now() const;
  void receive_requests();
  void handle(const std::string& routing_id, zmq::message_t& payload, const Peer& peer);
  // Answers a message that is not a valid request with `code`; a connection
  // that sends malformed_limit of them is ignored from then on.
  void reject_malformed(const std::string& routing_id, uint64_t request_id, ErrorCode code,
                        const std::string& why);
  void log_malformed(bool force);
  void apply(Effects& effects);
  // Creates a pool on every device served (devices, host_devices,
  // pool_size), in device_pools_. Throws naming the device and why.
  void create_pools(Backend backend);
  void send(Outgoing& o);
  void release_committed();
  // The store just failed: submissions it has not committed are withdrawn
  // (CoordinatorCore::withdraw_submission), their submitters refused now,
  // and their held messages dropped.
  void withdraw_unstored(Effects& effects);
  void wake_fd_drain();
  // The chunk socket's decision: the core says which chunks, the pools
  // provide them.
  ChunkServer::Decision decide_chunks(const ChunkRequest& req, pid_t peer_pid) const;
  // Hands the HTTP endpoint the status, the metrics and the jobs that
  // changed; note_for_http collects those and streams the events.
  void publish_http();
  void note_for_http(const Effects& effects);
  std::string http_address() const;  // HOST:PORT as bound (port 0 resolved)
  // Under MPS: checks that the control daemon answers, after a device fault
  // and every kMpsCheckInterval, and starts one of ours again if it is gone.
  void check_mps();

  CoordinatorOptions opts_;
  UniqueFd lock_fd_;                // flock on STATE_DIR/coordinator.lock
  UniqueFd wake_fd_;                // eventfd: the store writer or a file worker finished something
  std::unique_ptr<MpsDaemon> mps_;  // null: no MPS
  Clock::time_point mps_checked_{};
  uint64_t mps_faults_seen_ = 0;  // core's device_faults() at the last check
  bool mps_down_reported_ = false;
  // A pool per device served (create_pools), freed last but the store.
  std::vector<std::unique_ptr<DevicePool>> device_pools_;
  // Hands agents the descriptors of their chunks (after the pools: it
  // shares theirs; closed before them).
  std::unique_ptr<ChunkServer> chunks_;
  std::unique_ptr<CoordinatorCore> core_;
  std::unique_ptr<StoreWriter> store_;
  std::unique_ptr<FileWorkers> files_;
  std::unique_ptr<ChunkRenewer> renewer_;  // uses device_pools_ and wake_fd_
  std::unique_ptr<HttpEndpoint> http_;  // null: http_listen = off
  Clock::time_point http_published_{};
  std::set<uint64_t> http_jobs_changed_;  // since the last publish_http
  zmq::context_t ctx_;
  // Asked about every new connection (coordinator/zap_handler.h). After
  // the context, so its socket closes before the context ends; before the
  // sockets it guards, so they close first: a CURVE server without its
  // handler would let any key in.
  std::unique_ptr<ZapHandler> zap_;
  zmq::socket_t router_;
  zmq::socket_t pub_;
  std::deque<Held> held_;
  MalformedPeers malformed_;  // by routing id
  std::string store_error_;
};

}  // namespace leasehold
