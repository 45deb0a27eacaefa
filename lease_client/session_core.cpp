#include "lease_client/session_core.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "shared/protocol.h"

namespace leasehold::detail {
namespace {

flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<proto::AgentJob>>> pack_jobs(
    flatbuffers::FlatBufferBuilder& fbb, const std::vector<proto::AgentJobT>& jobs) {
  std::vector<flatbuffers::Offset<proto::AgentJob>> v;
  for (const auto& j : jobs) v.push_back(proto::AgentJob::Pack(fbb, &j));
  return fbb.CreateVector(v);
}

// The CUDA driver reads CUDA_MPS_PIPE_DIRECTORY once per process, when its
// first context is made (mapping the first CUDA pool makes it, unless the
// program made one before): what the variable said then holds for good.
struct MpsState {
  std::mutex mu;
  bool cuda_mapped = false;  // a CUDA pool was mapped in this process
  std::string joined;        // CUDA_MPS_PIPE_DIRECTORY at that time (empty: none)
};
MpsState& mps_state() {
  static MpsState state;
  return state;
}

}  // namespace

void SessionCore::notify_listener(const std::string& what) {
  std::lock_guard calling(handlers_mu);
  if (listener) listener(what);
}

std::vector<proto::AgentJobT> SessionCore::current_jobs() {
  std::lock_guard calling(handlers_mu);
  return jobs_provider ? jobs_provider() : std::vector<proto::AgentJobT>{};
}

void SessionCore::check_mps(const std::string& mps, const PoolDescriptor& desc) {
  if (desc.backend != Backend::Cuda) return;
  MpsState& state = mps_state();
  std::lock_guard lock(state.mu);
  if (state.cuda_mapped) {
    if (!mps.empty() && mps != state.joined) {
      spdlog::warn(
          "the coordinator now runs under the MPS daemon of {}; this process {}: restart "
          "it to join",
          mps, state.joined.empty() ? "joined none" : "joined " + state.joined);
    }
    return;
  }
  if (mps.empty()) return;
  const char* env = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
  if (!env && opts.join_mps) {
    // Read (and set) only before the first mapping: after it other threads
    // use CUDA, and the driver would not look at the variable again.
    ::setenv("CUDA_MPS_PIPE_DIRECTORY", mps.c_str(), 1);
    spdlog::info("joining the coordinator's MPS daemon ({})", mps);
  } else if (!env) {
    // Inside somebody else's process the environment is theirs: whoever
    // started it sets the variable (the agent does for its program jobs).
    spdlog::warn(
        "the coordinator runs under the MPS daemon of {}, this process under none "
        "(CUDA_MPS_PIPE_DIRECTORY is not set); mapping its pool may fail",
        mps);
  } else if (mps != env) {
    spdlog::warn("the coordinator runs under the MPS daemon of {}, this process under {}", mps,
                 env);
  }
}

void SessionCore::register_with(Connection& conn, std::chrono::milliseconds timeout) {
  conn.set_session({});
  // What this agent still runs or reports from an earlier session: the
  // coordinator will not start those jobs elsewhere until they are stopped.
  auto jobs = current_jobs();
  bool is_ready;
  uint64_t outside;
  uint32_t stale = 0;
  int preferred = -1;
  {
    std::lock_guard lock(mu);
    is_ready = ready;
    preferred = bound_device;
    outside = outside_pool_bytes;
    // Everything held now was granted before this registration.
    for (const auto& [e, n] : holds) stale += n;
  }
  const auto sent = std::chrono::steady_clock::now();
  Reply r = conn.request(
      [&](flatbuffers::FlatBufferBuilder& fbb) {
        auto name = fbb.CreateString(opts.name);
        auto list = pack_jobs(fbb, jobs);
        return std::pair{
            proto::Body::Register,
            proto::CreateRegister(fbb, name, getpid(), opts.device, list, opts.takes_jobs, is_ready,
                                  outside, static_cast<uint8_t>(opts.mps_thread_percentage),
                                  instance.lo, instance.hi, stale, opts.job_id, opts.attempt,
                                  opts.job_token.lo, opts.job_token.hi, preferred)
                .Union()};
      },
      timeout);
  r.throw_if_error();
  const auto* ack = r->body_as_RegisterAck();
  if (!ack || !ack->pool() || !ack->chunk_socket() || ack->chunk_socket()->size() == 0) {
    throw Error(ErrorCode::Malformed,
                "coordinator answered Register without a pool or its chunk socket");
  }
  const auto* p = ack->pool();
  PoolDescriptor desc;
  desc.backend = p->backend() == proto::Backend::Cuda ? Backend::Cuda : Backend::Host;
  desc.device = p->device();
  desc.device_name = std::string(str(p->device_name()));
  desc.size = p->size();
  desc.alignment = p->alignment();
  desc.epoch = p->epoch();
  desc.uuid = std::string(str(p->uuid()));
  {
    std::lock_guard lock(mu);
    if (bound_device >= 0 && bound_device != p->device()) {
      spdlog::warn(
          "the coordinator bound this process to device {}, not device {} as before (it "
          "no longer serves that one?): restart it to work on the new device alone",
          p->device(), bound_device);
    }
    bound_device = p->device();
  }

  std::shared_ptr<PoolMapping> m;
  {
    std::lock_guard lock(mu);
    if (mapping && mapping->descriptor().epoch == desc.epoch) m = mapping;
  }
  // The same pool's range is reserved only once per process; a new pool
  // means the coordinator restarted.
  if (!m) {
    // The coordinator's MPS daemon, joined before this process's first CUDA
    // call (mapping the pool creates its context); the driver reads the
    // folder only then, so a later change needs the process restarted.
    check_mps(std::string(str(ack->mps_pipe_directory())), desc);
    if (desc.backend == Backend::Cuda && !desc.uuid.empty()) {
      // The coordinator's ordinal is its own numbering: this process may
      // see the GPU under another (a program job sees only its GPU, as 0).
      const int local = cuda_ordinal_of(desc.uuid);
      if (local < 0) {
        throw std::runtime_error("the coordinator's pool is on GPU " + desc.uuid + " (its device " +
                                 std::to_string(desc.device) +
                                 "), which this process cannot see (CUDA_VISIBLE_DEVICES?)");
      }
      desc.device = local;
    }
    m = map_pool(desc);
    if (desc.backend == Backend::Cuda) {
      MpsState& state = mps_state();
      std::lock_guard lock(state.mu);
      if (!state.cuda_mapped) {
        state.cuda_mapped = true;
        const char* now = std::getenv("CUDA_MPS_PIPE_DIRECTORY");
        state.joined = now ? now : "";
      }
    }
  }
  {
    std::lock_guard lock(mu);
    session = SessionToken{ack->session(), ack->session_hi()};
    ++epoch;
    connected = true;
    mapping = std::move(m);
    const std::string chunk_socket(str(ack->chunk_socket()));
    if (!chunks || chunks->path() != chunk_socket) chunks = std::make_shared<ChunkClient>(chunk_socket);
    heartbeat_interval =
        std::chrono::milliseconds(std::max<uint32_t>(ack->heartbeat_interval_ms(), 10));
    default_wait = std::chrono::milliseconds(ack->default_wait_ms());
    // A coordinator that does not say fences after two heartbeats.
    const auto silence_limit = ack->silence_limit_ms()
                                   ? std::chrono::milliseconds(ack->silence_limit_ms())
                                   : 2 * heartbeat_interval;
    self_fence = silence_limit * 3 / 4;
    last_heard = sent;
    coordinator = SessionToken{ack->coordinator_instance_lo(), ack->coordinator_instance_hi()};
    silence_noted = false;
  }
  conn.set_session(SessionToken{ack->session(), ack->session_hi()});
  cv.notify_all();
  spdlog::info("registered as '{}' with {} ({} pool of {} bytes on {})", opts.name, opts.endpoint,
               backend_name(desc.backend), desc.size, desc.device_name);
}

void SessionCore::heard(std::chrono::steady_clock::time_point sent) {
  std::chrono::milliseconds silent{0};
  {
    std::lock_guard lock(mu);
    if (sent <= last_heard) return;
    if (silence_noted) {
      silent = std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::steady_clock::now() - last_heard);
      silence_noted = false;
    }
    last_heard = sent;
  }
  cv.notify_all();
  if (silent.count() > 0) {
    spdlog::info(
        "the coordinator at {} answers again after {} ms; the session and its leases "
        "hold",
        opts.endpoint, silent.count());
  }
}

void SessionCore::unanswered() {
  std::chrono::milliseconds silent;
  {
    std::lock_guard lock(mu);
    const auto now = std::chrono::steady_clock::now();
    if (silence_noted || !connected || now - last_heard < self_fence) return;
    silence_noted = true;
    silent = std::chrono::duration_cast<std::chrono::milliseconds>(now - last_heard);
  }
  spdlog::warn(
      "the coordinator at {} has not answered for {} ms (paused, busy or restarting); "
      "leased memory is left untouched until it answers, and the session is void only "
      "if another instance answers",
      opts.endpoint, silent.count());
}

uint32_t SessionCore::stale_holds() const {
  uint32_t n = 0;
  for (const auto& [e, count] : holds) n += e != epoch ? count : 0;
  return n;
}

void SessionCore::lose(const std::string& why) {
  {
    std::lock_guard lock(mu);
    if (!connected) return;
    connected = false;
  }
  cv.notify_all();
  spdlog::warn("session with {} lost: {}; leases are void, registering again", opts.endpoint, why);
  notify_listener(why);
}

void SessionCore::handle_push(const Reply& r) {
  switch (r->body_type()) {
    case proto::Body::Shutdown:
      lose("the coordinator shut down");
      break;
    case proto::Body::Shrink: {
      proto::ShrinkT s;
      r->body_as_Shrink()->UnPackTo(&s);
      SessionToken ours;
      {
        std::lock_guard lock(mu);
        if (connected) ours = session;
      }
      // Only the coordinator can push on this socket, but a Shrink meant for
      // another agent (or an earlier session) must not cost this one memory.
      if (s.agent != opts.name || ours.empty() || SessionToken{s.session, s.session_hi} != ours) {
        spdlog::warn("refusing shrink {} addressed to agent '{}' of another session (this is '{}')",
                     s.id, s.agent, opts.name);
        break;
      }
      std::lock_guard calling(handlers_mu);
      if (on_shrink) on_shrink(s);
      break;
    }
    default: {
      // The agent's business (AssignJob, StopJob: agent/job_channel.h).
      std::lock_guard calling(handlers_mu);
      if (on_push) on_push(r.envelope());
      break;
    }
  }
}

void SessionCore::heartbeat_loop(std::unique_ptr<Connection> conn) {
  conn->on_notice = [this](const Reply& r) { handle_push(r); };
  while (!stop.load()) {
    try {
      heartbeat_turn(*conn);
    } catch (const std::exception& e) {
      // An interrupted call or a failed allocation must not end the thread
      // (that would leave the agent registered but silent).
      spdlog::warn("heartbeat thread: {}", e.what());
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
}

void SessionCore::heartbeat_turn(Connection& conn) {
  std::chrono::milliseconds interval;
  bool is_connected;
  SessionToken instance_now;
  {
    std::unique_lock lock(mu);
    interval = heartbeat_interval;
    is_connected = connected;
    instance_now = coordinator;
  }
  heartbeat_due.store(false);
  if (is_connected) {
    try {
      auto jobs = current_jobs();
      bool is_ready;
      uint64_t outside;
      uint32_t stale;
      {
        std::lock_guard lock(mu);
        is_ready = ready;
        outside = outside_pool_bytes;
        stale = stale_holds();
      }
      const auto sent = std::chrono::steady_clock::now();
      Reply r = conn.request(
          [&](flatbuffers::FlatBufferBuilder& fbb) {
            auto list = pack_jobs(fbb, jobs);
            return std::pair{proto::Body::Heartbeat,
                             proto::CreateHeartbeat(fbb, list, is_ready, outside, stale).Union()};
          },
          interval);
      if (r->body_type() == proto::Body::Error &&
          r->body_as_Error()->code() == ErrorCode::UnknownSender) {
        lose(std::string(str(r->body_as_Error()->message())));
      } else if (const auto* ack = r->body_as_HeartbeatAck();
                 ack && SessionToken{ack->coordinator_instance_lo(),
                                     ack->coordinator_instance_hi()} != instance_now) {
        lose("another instance of the coordinator answers (it restarted)");
      } else {
        heard(sent);
      }
    } catch (const Error&) {
      // Silence is not a restart: the leases hold until the coordinator
      // answers as another instance (or without the session). Meanwhile
      // may_touch() keeps the job off leased memory past the self-fence,
      // which ends before the coordinator could fence it.
      unanswered();
      return;  // the request already waited one interval
    }
  } else {
    try {
      register_with(conn, std::max(interval, std::chrono::milliseconds(500)));
      last_register_error.clear();
      notify_listener("");
    } catch (const Error& e) {
      // While the coordinator is away this fails every turn: only other
      // failures are worth a warning, once each.
      if (e.code() == ErrorCode::Timeout) {
        spdlog::debug("registration attempt failed: {}", e.what());
      } else if (e.what() != last_register_error) {
        spdlog::warn("registration attempt failed: {}", e.what());
        last_register_error = e.what();
      }
    } catch (const std::exception& e) {
      // Mapping the new pool failed (a CUDA error, a missing segment).
      if (e.what() != last_register_error) {
        spdlog::error("registration attempt failed: {}", e.what());
        last_register_error = e.what();
      }
    }
  }
  // Late lease grants on the control socket, while nobody else uses it;
  // never waiting long, the next heartbeat is due.
  if (std::unique_lock lock(control_mu, std::try_to_lock); lock.owns_lock()) {
    release_strays(interval / 2);
  }
  // Until the next heartbeat, take what the coordinator pushes (jobs); a
  // push makes the next heartbeat go at once.
  auto next = std::chrono::steady_clock::now() + interval;
  while (!stop.load() && !heartbeat_due.load()) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        next - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    if (auto pushed = conn.receive(std::min(left, std::chrono::milliseconds(100)))) {
      if ((*pushed)->header()->request_id() == 0) handle_push(*pushed);
    }
  }
}

void SessionCore::note_late_reply(const Reply& r) {
  // Only grants for requests that gave up: a late reply to a resize is a
  // LeaseGrant too, for a lease its caller still holds.
  if (!abandoned_requests.erase(r->header()->request_id())) return;
  if (const auto* g = r->body_as_LeaseGrant(); g && g->lease()) {
    spdlog::warn("lease {} ({} bytes) was granted after its request gave up; releasing it",
                 g->lease()->id(), g->lease()->size());
    stray_leases.push_back(g->lease()->id());
  } else if (const auto* rg = r->body_as_RegionGrant(); rg && rg->region()) {
    spdlog::warn("region '{}' was attached after the request gave up; detaching it",
                 std::string(str(rg->region()->name())));
    stray_regions.emplace_back(str(rg->region()->name()));
  }
}

void SessionCore::release_strays(std::chrono::milliseconds timeout) {
  while (auto late = control->receive(std::chrono::milliseconds(0))) {
    if ((*late)->header()->request_id() != 0) {
      note_late_reply(*late);
    } else if (control->on_notice) {
      control->on_notice(*late);
    }
  }
  if (stray_leases.empty() && stray_regions.empty()) return;
  SessionToken token;
  {
    std::lock_guard lock(mu);
    if (!connected) return;  // a lost session's leases are void anyway
    token = session;
  }
  control->set_session(token);
  for (uint64_t id : std::exchange(stray_leases, {})) {
    try {
      control->request(release_body(id), timeout).throw_if_error();
    } catch (const std::exception& e) {
      spdlog::warn("could not release late lease {}: {}", id, e.what());
    }
  }
  for (const std::string& name : std::exchange(stray_regions, {})) {
    try {
      control->request(detach_body(name), timeout).throw_if_error();
    } catch (const std::exception& e) {
      spdlog::warn("could not detach late region '{}': {}", name, e.what());
    }
  }
}

Reply control_request(SessionCore& core, const Connection::BodyBuilder& build,
                      std::chrono::milliseconds timeout, uint64_t* epoch_out, bool grants_lease) {
  SessionToken session;
  uint64_t epoch;
  {
    std::lock_guard lock(core.mu);
    if (!core.connected) {
      throw Error(ErrorCode::UnknownSender,
                  "agent '" + core.opts.name + "' is not registered with the coordinator at " +
                      core.opts.endpoint + " right now (it restarted or is unreachable)");
    }
    session = core.session;
    epoch = core.epoch;
  }
  if (epoch_out) *epoch_out = epoch;
  std::unique_lock lock(core.control_mu);
  core.control->set_session(session);
  // Only a wait for memory is given up when the agent stops; the quick
  // requests of an orderly end (releases, the last reports) still go.
  core.control->interrupt = grants_lease ? core.opts.interrupt : nullptr;
  Reply r;
  const auto sent = std::chrono::steady_clock::now();
  try {
    r = core.control->request(build, timeout);
  } catch (const Error& e) {
    if (grants_lease && (e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Interrupted)) {
      core.abandoned_requests.insert(core.control->last_request_id());
    }
    throw;
  }
  core.release_strays(core.opts.request_timeout);
  lock.unlock();
  if (r->body_type() == proto::Body::Error &&
      r->body_as_Error()->code() == ErrorCode::UnknownSender) {
    // A coordinator that does not know our token restarted (or dropped us):
    // the session is over now, before the caller sees the error, so nobody
    // mistakes it for a refusal (a lease refused is "out of memory").
    core.lose(std::string(str(r->body_as_Error()->message())));
  } else {
    core.heard(sent);
  }
  r.throw_if_error();
  return r;
}

Connection::BodyBuilder release_body(uint64_t lease_id) {
  return [lease_id](flatbuffers::FlatBufferBuilder& fbb) {
    return std::pair{proto::Body::LeaseRelease, proto::CreateLeaseRelease(fbb, lease_id).Union()};
  };
}

Connection::BodyBuilder detach_body(const std::string& name) {
  return [name](flatbuffers::FlatBufferBuilder& fbb) {
    return std::pair{proto::Body::DetachRegion,
                     proto::CreateDetachRegion(fbb, fbb.CreateString(name)).Union()};
  };
}

void release_lease(SessionCore& core, uint64_t id) {
  control_request(core, release_body(id), core.opts.request_timeout, nullptr);
}

}  // namespace leasehold::detail
