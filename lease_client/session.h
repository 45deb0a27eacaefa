// The lease client: a process's session with the coordinator (registration,
// heart-beats, the pool's address range and the chunks of each lease and
// region mapped into it, leases, shared cache regions, Shrink requests). The agent asks an AgentSession for leases and gets usable
// memory (a device pointer on cuda, a host pointer on host) for each; the C
// interface of libleasehold.so (lease_client/leasehold.h) wraps the same
// classes for other programs (the PyTorch plug-in).
//
// It knows nothing of jobs: an agent's job traffic (AssignJob, StopJob,
// JobUpdate, the jobs listed in every heartbeat) goes through the generic
// hooks below (set_jobs_provider, set_push_handler, request); the agent's
// JobChannel (agent/job_channel.h) gives them their meaning.
//
// These classes and the C interface are all that libleasehold.so exports
// (lease_client/exports.map). Nothing here sets environment variables
// unless told to (AgentOptions::join_mps), changes the calling thread's
// current CUDA device (it is restored after mapping the pool) or
// synchronizes the whole device.
//
// Threads: a background thread heart-beats on its own socket, notices a
// coordinator that restarted or shut down, and registers again when one is
// back. A lease granted after its request gave up (timed out) is released
// by the session, never leaked. Requests (acquire/resize/release) may come
// from any thread; they are serialized on one control socket, so a request
// that waits for memory holds up the others from this session (heart-beats
// are not held up).
//
// When the session is lost (the coordinator restarted or declared this agent
// dead), every lease obtained before is void: Lease::lost() turns true, and
// its memory must not be used; the pool mapping stays valid until the last
// Lease of it is gone, so stray accesses cannot fault.
//
// Two clocks keep a paused agent from writing into memory that was handed to
// someone else. The coordinator fences an agent's leases after
// RegisterAck.silence_limit_ms without a message from it, and gives them to
// nobody while its process may still run. The agent stops touching leased
// memory strictly earlier: may_touch() turns false once the coordinator has
// not answered anything sent within 3/4 of that limit, measured from when
// the answered message was sent (so the coordinator's clock started later).
// Code that touches leases checks it at its step boundaries and waits
// (wait_may_touch). Leases and attachments still held from a lost session
// are reported in every Register and Heartbeat: the coordinator keeps that
// memory fenced until none is held.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shared/chunk_channel.h"
#include "shared/connection.h"
#include "shared/curve_keys.h"
#include "shared/device.h"
#include "shared/error.h"
#include "shared/session_token.h"
#include "schemas/leasehold_generated.h"

namespace leasehold {

namespace detail {
struct SessionCore;

// What a Lease and a RegionAttachment share: the session that granted them
// and the mapping of the pool their memory is in. The session counts the
// holds of each registration (its stale holds, above). Moving leaves the
// source empty.
struct PoolHold {
  PoolHold() = default;
  PoolHold(std::shared_ptr<SessionCore> core, std::shared_ptr<PoolMapping> mapping,
           uint64_t epoch);
  PoolHold(PoolHold&& o) noexcept { *this = std::move(o); }
  PoolHold& operator=(PoolHold&& o) noexcept;
  PoolHold(const PoolHold&) = delete;
  PoolHold& operator=(const PoolHold&) = delete;
  ~PoolHold() { clear(); }

  std::shared_ptr<SessionCore> core;
  std::shared_ptr<PoolMapping> mapping;
  uint64_t epoch = 0;  // the session's registration that granted it
  // The chunks of the pool it mapped (its lease's or region's, from the
  // chunk socket), and how.
  uint64_t first_chunk = 0, chunk_count = 0;
  Access access = Access::ReadWrite;

  bool held() const { return core != nullptr; }
  // True when the session that granted it is gone (coordinator restart).
  bool lost() const;
  Backend backend() const;
  int device() const;
  // The pool's memory at `offset`. Throws Error{code} with `what` when not
  // held, and saying so when lost.
  std::byte* at(uint64_t offset, ErrorCode code, const std::string& what) const;
  // Asks the chunk socket for `req`'s chunks and maps them, from chunk
  // first_chunk + chunk_count on (a lease grown in place), so that
  // [first, first + count) is mapped; the coordinator must grant exactly
  // that range. Throws Error{code} with `what`; what this call mapped is
  // unmapped again then.
  void map(ChunkRequest req, uint64_t first, uint64_t count, ErrorCode code,
           const std::string& what);
  // Read-only from now on (a region this process filled).
  void narrow() noexcept;
  // Unmaps chunks from `keep` on (all by default): the memory is out of
  // this process's reach before the coordinator hears it is given up.
  void unmap(uint64_t keep = 0) noexcept;
  // Not held any more (unmapped, no longer counted).
  void clear() noexcept;
};
}  // namespace detail

enum class LeaseEnd { Low, High };

struct AgentOptions {
  std::string endpoint;          // coordinator endpoint
  // CURVE keys for a network endpoint (shared/curve_keys.h); nullopt: ipc.
  std::optional<CurveClientKeys> curve;
  std::string name;              // unique among the coordinator's agents
  int device = -1;               // -1: whatever device the pool is on
  // How long a request that does not wait for memory may take.
  std::chrono::milliseconds request_timeout{5000};
  // How long the constructor keeps trying to register.
  std::chrono::milliseconds register_timeout{10000};
  // A standby worker that runs the jobs the coordinator assigns (it must
  // install a push handler for them: agent/job_channel.h); false: it only
  // leases memory and gets no job.
  bool takes_jobs = false;
  // False: it registers warming up and gets no job until set_ready().
  bool ready = true;
  // When set, lease and region requests waiting for memory, and the
  // constructor's registration, give up with Error{Interrupted} once it
  // turns true (SIGTERM).
  const std::atomic<bool>* interrupt = nullptr;
  // Its share of the GPU's threads under MPS (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE,
  // set by the caller before any CUDA call); 0: all. Reported to the coordinator.
  int mps_thread_percentage = 0;
  // Join the coordinator's MPS daemon: before this process's first CUDA
  // call (the first mapping of a CUDA pool) set CUDA_MPS_PIPE_DIRECTORY to
  // the folder RegisterAck names, unless the environment names one already.
  // True only for a process whose environment is its own (the agent);
  // false (the default, and always through the C interface): the
  // environment is left alone and a mismatch is only logged.
  bool join_mps = false;
  // A program job's own session (its process, started by the agent that
  // runs the job; Register.job_id etc.): its leases count as the job's,
  // within the job's memory budget. job_id 0: none.
  uint64_t job_id = 0;
  uint32_t attempt = 0;
  SessionToken job_token;  // the attempt's token from AssignJob
};

// A lease and its memory. Move-only; releasing happens in release() or, best
// effort, in the destructor.
class Lease {
 public:
  Lease() = default;
  Lease(Lease&&) noexcept;
  Lease& operator=(Lease&&) noexcept;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease();

  uint64_t id() const { return id_; }
  uint64_t offset() const { return offset_; }
  uint64_t size() const { return size_; }
  uint64_t generation() const { return generation_; }
  LeaseEnd end() const { return end_; }
  Backend backend() const { return hold_.backend(); }
  int device() const { return hold_.device(); }
  // False for a default-constructed or released lease.
  bool held() const { return hold_.held(); }
  // True when the session that granted it is gone (coordinator restart).
  bool lost() const { return hold_.lost(); }
  // The mapping of the pool its chunks are mapped in (null when not held):
  // a chunk window (shared/chunk_window.h) shows them only from there.
  const std::shared_ptr<PoolMapping>& mapping() const { return hold_.mapping; }
  // The lease's memory. Throws Error{NoSuchLease} when the lease is not held
  // or was lost.
  std::byte* data() const;
  // Gives the lease back to the coordinator (nothing to give when it was
  // lost: the coordinator took it back); afterwards held() is false, also
  // when this throws (unlike AgentSession::release, which keeps a lease
  // whose release failed, for another try). Needs no AgentSession object
  // (once the session is gone the lease is lost). Throws
  // Error{NoSuchLease} when not held, and the coordinator's refusal or
  // Timeout.
  void release();

 private:
  friend class AgentSession;
  // Releases the lease if it is held and not lost (best effort, logged).
  void reset() noexcept;

  detail::PoolHold hold_;
  uint64_t id_ = 0, offset_ = 0, size_ = 0, generation_ = 0;
  LeaseEnd end_ = LeaseEnd::Low;
};

// An attachment to a shared cache region (coordinator/regions.md): while it
// is held the coordinator never evicts the region, so its bytes stay. The
// first attacher of a new region must fill it and call mark_ready(); the
// others get it once it is ready. Move-only; detach() or, best effort, the
// destructor gives the attachment back (a region left unfilled is then
// discarded). Like a Lease it is void once the session is lost.
class RegionAttachment {
 public:
  RegionAttachment() = default;
  RegionAttachment(RegionAttachment&&) noexcept;
  RegionAttachment& operator=(RegionAttachment&&) noexcept;
  RegionAttachment(const RegionAttachment&) = delete;
  RegionAttachment& operator=(const RegionAttachment&) = delete;
  ~RegionAttachment();

  const std::string& name() const { return name_; }
  uint64_t size() const { return size_; }
  uint64_t offset() const { return offset_; }
  // This attacher fills the region (a new one) and then calls mark_ready().
  bool must_fill() const { return must_fill_; }
  Backend backend() const { return hold_.backend(); }
  int device() const { return hold_.device(); }
  bool held() const { return hold_.held(); }
  // True when the session that granted it is gone.
  bool lost() const { return hold_.lost(); }
  // The region's memory (device memory on cuda). Throws Error{NoSuchRegion}
  // when not held or lost.
  std::byte* data() const;
  // The region is filled: other attachers may use it now. The writes must
  // have finished (fence the device first). Throws Error.
  void mark_ready();
  // Gives the attachment back. Throws Error.
  void detach();

 private:
  friend class AgentSession;
  void reset() noexcept;

  detail::PoolHold hold_;
  std::string name_;
  uint64_t offset_ = 0, size_ = 0;
  bool must_fill_ = false;
};

class AgentSession {
 public:
  // Connects, registers and maps the pool. Keeps retrying while the
  // coordinator is unreachable, the name is still held by a dead agent, or
  // the pool cannot be mapped (its coordinator died meanwhile), up to
  // register_timeout; then throws Error naming the cause.
  explicit AgentSession(AgentOptions opts);
  // Stops heart-beating and unregisters (best effort); leases still held are
  // released by the coordinator with the registration.
  ~AgentSession();
  AgentSession(const AgentSession&) = delete;
  AgentSession& operator=(const AgentSession&) = delete;

  // Requests a lease of at least `size` bytes (rounded up to the pool's
  // alignment). `wait`: how long the coordinator may queue the request when
  // memory is short (nullopt: its default; 0: fail at once). `needed`: the
  // job cannot go on without it (LeaseRequest.needed). Throws Error:
  // TooLarge (can never fit), NoSpace, Timeout, UnknownSender (session lost).
  Lease acquire(uint64_t size, LeaseEnd end = LeaseEnd::Low,
                std::optional<std::chrono::milliseconds> wait = std::nullopt,
                bool needed = false);
  // Resizes in place (shrinking always works; growing only into free space
  // right after the lease). Throws Error; the lease is unchanged then.
  void resize(Lease& lease, uint64_t size);
  // Releases the lease; afterwards held() is false. Throws Error; the
  // lease is still held then (its destructor tries again).
  void release(Lease& lease);

  // Attaches the shared cache region `name`. When it does not exist and
  // `create` is set it is created with `size` bytes and the result says
  // must_fill(); while another agent fills it this waits (up to `wait`,
  // nullopt: the coordinator's lease wait). `size` 0 without `create`:
  // whatever size it has. `replace`: an unattached region of that name is
  // discarded and created anew (publishing new contents). Throws Error:
  // NoSuchRegion (absent, evicted, or its filler died and this may not
  // create it), NoSpace (no room for a new one), RegionBusy, Timeout,
  // InvalidArgument (a bad name, a different size), UnknownSender.
  RegionAttachment attach_region(const std::string& name, uint64_t size, bool create,
                                 std::optional<std::chrono::milliseconds> wait = std::nullopt,
                                 bool replace = false);

  // A warming standby worker is ready for jobs now; its device memory
  // outside the pool is `outside_pool_bytes`. Sent with the next heartbeat
  // (at once) and every registration after.
  void set_ready(bool ready, uint64_t outside_pool_bytes);

  // The pool of the current session.
  PoolDescriptor pool() const;
  // Its first byte in this process (a device pointer on cuda). Another
  // address after a coordinator restart (a new pool).
  std::byte* pool_base() const;
  const std::string& name() const;
  // Number of successful registrations so far (1 after construction).
  uint64_t registrations() const;
  // True while registered with a live coordinator.
  bool connected() const;
  // Whether leased memory may be touched now: registered, and the
  // coordinator answered a message sent less than the self-fence deadline
  // ago (3/4 of its silence limit; see above).
  bool may_touch() const;
  // Waits while registered but past that deadline. True once the
  // coordinator answers again; false when the session is lost or
  // `give_up()` (polled about every 50 ms) returns true.
  bool wait_may_touch(const std::function<bool()>& give_up) const;
  // Blocks until registered again after a loss, or `timeout`; returns connected().
  bool wait_connected(std::chrono::milliseconds timeout) const;
  // Called from the heartbeat thread when the session is lost (argument: why)
  // and when it is re-established (argument: empty). Set before leases are
  // used; it must not call back into the session. Setting another (or an
  // empty one) waits for a call in progress, so whatever the old one used
  // may go away afterwards.
  void set_session_listener(std::function<void(const std::string&)> listener);

  // What every Register and Heartbeat lists as this process's jobs (how the
  // coordinator learns that a push was acted on, and what an agent still
  // runs after a restart); none when unset. Called from the heartbeat
  // thread; it must not call back into the session. Like the listener,
  // replacing it waits for a call in progress.
  void set_jobs_provider(std::function<std::vector<proto::AgentJobT>()> jobs);
  // Messages the coordinator pushes (request id 0) that the session does
  // not handle itself (it handles Shutdown and Shrink): AssignJob, StopJob.
  // Called from the heartbeat thread with the verified envelope (valid
  // during the call); it must return quickly (queue the work) and must not
  // call back into the session, except heartbeat_soon(). Set before the
  // coordinator may push (right after construction). Like the listener,
  // replacing it waits for a call in progress.
  void set_push_handler(std::function<void(const proto::Envelope&)> on_push);
  // Shrink requests of the coordinator (the occupancy policy), called from
  // the heartbeat thread; it must return quickly (the agent acts at its
  // job's next step boundary and answers with send_shrink_done). A Shrink
  // addressed to another agent or another session is refused (logged) and
  // never reaches the handler.
  void set_shrink_handler(std::function<void(const proto::ShrinkT&)> on_shrink);
  // Answers Shrink `id`: `released` bytes given back (their leases are
  // released already), `leased` still held. Throws Error.
  void send_shrink_done(uint64_t id, uint64_t released, uint64_t leased,
                        const std::string& reason);
  // Sends the next heartbeat now rather than at the interval (what the jobs
  // provider returns has changed).
  void heartbeat_soon();
  // Sends a control request (built by `build`) with this session's token
  // and returns the coordinator's answer; `timeout` nullopt: the session's
  // request_timeout. For requests the session has no method of its own for
  // (an agent's JobUpdate); not for requests that grant memory (leases and
  // regions, whose late grants must be given back). Thread-safe; serialized
  // with the other requests. Throws Error: the coordinator's refusal,
  // Timeout, UnknownSender (the session is lost, or not registered now).
  Reply request(const Connection::BodyBuilder& build,
                std::optional<std::chrono::milliseconds> timeout = std::nullopt);

  // The secret the coordinator knows the current registration by (empty
  // while not registered): what the chunk socket's requests carry. Never
  // log or pass it on.
  SessionToken session_token() const;
  // The pool's range in this process as this registration sees it, with
  // what is mapped into it (PoolMapping::access).
  std::shared_ptr<PoolMapping> current_mapping() const;

 private:
  std::shared_ptr<detail::SessionCore> core_;
};

}  // namespace leasehold
