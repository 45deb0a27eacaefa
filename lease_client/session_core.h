// The inside of an AgentSession (lease_client/session.h): registration, the
// heartbeat thread, pushed messages, and the control socket's requests.
// Shared by the session and every Lease it hands out, so that a Lease can be
// released after the session object is gone. Not a public interface.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "lease_client/session.h"
#include "shared/connection.h"

namespace leasehold::detail {

struct SessionCore {
  explicit SessionCore(AgentOptions o) : opts(std::move(o)), ctx(1), ready(opts.ready) {}

  AgentOptions opts;
  zmq::context_t ctx;
  // Chosen once: proves to the coordinator that a Register for our own
  // name comes from us (we lost our session) and not from someone else.
  const SessionToken instance = SessionToken::random();

  std::mutex control_mu;                // serializes requests on `control`
  std::unique_ptr<Connection> control;  // GUARDED_BY(control_mu)
  // Lease requests that gave up (timed out), by request id: a grant that
  // still comes for one is released. GUARDED_BY(control_mu)
  std::set<uint64_t> abandoned_requests;
  // Leases granted after their request timed out: released as soon as the
  // control socket is free. GUARDED_BY(control_mu)
  std::vector<uint64_t> stray_leases;
  // Likewise regions attached after their request timed out: detached.
  std::vector<std::string> stray_regions;

  // Held while the listener or a handler (jobs provider, push, shrink)
  // runs, and while they are replaced, so a replaced one is never running
  // afterwards.
  std::mutex handlers_mu;
  mutable std::mutex mu;  // guards everything below
  mutable std::condition_variable cv;
  SessionToken session;
  uint64_t epoch = 0;  // registrations so far; a Lease of another epoch is lost
  bool connected = false;
  // When the latest message the coordinator answered was sent, and how long
  // after it this agent may still touch leased memory (the self-fence).
  std::chrono::steady_clock::time_point last_heard{};
  std::chrono::milliseconds self_fence{1500};
  // The coordinator's start this session registered with (RegisterAck):
  // another one answering means it restarted; the same one after a
  // silence, that it was only paused.
  SessionToken coordinator;
  bool silence_noted = false;  // the heartbeat thread logged the silence
  // Leases and attachments held, by the registration that granted them.
  std::map<uint64_t, uint32_t> holds;
  bool ready = true;                 // see AgentOptions::ready
  uint64_t outside_pool_bytes = 0;   // reported with it
  std::shared_ptr<PoolMapping> mapping;
  // The coordinator's chunk socket (RegisterAck.chunk_socket).
  std::shared_ptr<ChunkClient> chunks;
  // The coordinator's ordinal of the device it was first bound to (-1:
  // none yet): asked for again at every registration.
  int bound_device = -1;
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds default_wait{30000};
  std::function<void(const std::string&)> listener;
  std::function<std::vector<proto::AgentJobT>()> jobs_provider;
  std::function<void(const proto::Envelope&)> on_push;
  std::function<void(const proto::ShrinkT&)> on_shrink;

  std::atomic<bool> stop{false};
  std::atomic<bool> heartbeat_due{false};  // send one now (after a push)
  std::string last_register_error;  // heartbeat thread only: logged once
  std::thread heartbeat;

  void register_with(Connection& conn, std::chrono::milliseconds timeout);
  // Before mapping a CUDA pool: joins (AgentOptions::join_mps) or checks
  // the coordinator's MPS daemon `mps` (empty: none).
  void check_mps(const std::string& mps, const PoolDescriptor& desc);
  // The coordinator answered a message sent at `sent` (not a refusal of
  // the session): it saw this agent then.
  void heard(std::chrono::steady_clock::time_point sent);
  // A heartbeat went unanswered: the coordinator may be paused, starved or
  // restarting. Nothing is void until it answers as another instance (or
  // no longer knows the session); until then may_touch() ends the use of
  // leased memory at the self-fence. Logged once per silence.
  void unanswered();
  // Holds of registrations other than the current one. REQUIRES: mu held.
  uint32_t stale_holds() const;
  // REQUIRES: mu held.
  bool may_touch_locked(std::chrono::steady_clock::time_point now) const {
    return connected && now - last_heard < self_fence;
  }
  void lose(const std::string& why);
  // Acts on a message the coordinator pushed (request id 0).
  void handle_push(const Reply& r);
  void heartbeat_loop(std::unique_ptr<Connection> conn);
  // One heartbeat (or registration attempt) and the pushes until the next.
  void heartbeat_turn(Connection& conn);
  void notify_listener(const std::string& what);
  std::vector<proto::AgentJobT> current_jobs();
  // Remembers a lease or region granted to a request that had given up.
  void note_late_reply(const Reply& r);  // REQUIRES: control_mu held
  // Releases the stray leases and detaches the stray regions (waiting up to
  // `timeout` for each answer),
  // and takes late replies waiting on the control socket first. REQUIRES:
  // control_mu held.
  void release_strays(std::chrono::milliseconds timeout);
};

// Sends a control request with the current session token. Throws Error.
// `grants_lease`: a LeaseRequest or AttachRegion, whose grant, if it comes
// after the request gave up, is released (detached).
Reply control_request(SessionCore& core, const Connection::BodyBuilder& build,
                      std::chrono::milliseconds timeout, uint64_t* epoch_out,
                      bool grants_lease = false);
void release_lease(SessionCore& core, uint64_t id);
// The body of a LeaseRelease of `lease_id`.
Connection::BodyBuilder release_body(uint64_t lease_id);
// The body of a DetachRegion of `name`.
Connection::BodyBuilder detach_body(const std::string& name);

}  // namespace leasehold::detail
