#include "agent/session.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <mutex>
#include <thread>

#include "shared/connection.h"
#include "shared/protocol.h"

namespace leasehold {
namespace detail {

struct SessionCore {
  explicit SessionCore(AgentOptions o) : opts(std::move(o)), ctx(1) {}

  AgentOptions opts;
  zmq::context_t ctx;

  std::mutex control_mu;                // serializes requests on `control`
  std::unique_ptr<Connection> control;  // GUARDED_BY(control_mu)

  mutable std::mutex mu;  // guards everything below
  mutable std::condition_variable cv;
  uint64_t session = 0;
  uint64_t epoch = 0;  // registrations so far; a Lease of another epoch is lost
  bool connected = false;
  std::shared_ptr<PoolMapping> mapping;
  std::chrono::milliseconds heartbeat_interval{1000};
  std::chrono::milliseconds default_wait{30000};
  std::function<void(const std::string&)> listener;
  std::function<void(uint64_t, std::vector<uint8_t>)> on_assign;
  std::function<void(uint64_t)> on_stop;

  std::atomic<bool> stop{false};
  std::thread heartbeat;

  void register_with(Connection& conn, std::chrono::milliseconds timeout);
  void lose(const std::string& why);
  // Acts on a message the coordinator pushed (request id 0).
  void handle_push(const Reply& r);
  void heartbeat_loop(std::unique_ptr<Connection> conn);
  void notify_listener(const std::string& what) {
    std::function<void(const std::string&)> l;
    {
      std::lock_guard lock(mu);
      l = listener;
    }
    if (l) l(what);
  }
};

void SessionCore::register_with(Connection& conn, std::chrono::milliseconds timeout) {
  conn.set_session(0);
  Reply r = conn.request(
      [&](flatbuffers::FlatBufferBuilder& fbb) {
        auto name = fbb.CreateString(opts.name);
        return std::pair{proto::Body::Register,
                         proto::CreateRegister(fbb, name, getpid(), opts.device).Union()};
      },
      timeout);
  r.throw_if_error();
  const auto* ack = r->body_as_RegisterAck();
  if (!ack || !ack->pool() || !ack->pool()->handle()) {
    throw Error(ErrorCode::Malformed, "coordinator answered Register without a pool");
  }
  const auto* p = ack->pool();
  PoolDescriptor desc;
  desc.backend = p->backend() == proto::Backend::Cuda ? Backend::Cuda : Backend::Host;
  desc.device = p->device();
  desc.device_name = std::string(str(p->device_name()));
  desc.size = p->size();
  desc.alignment = p->alignment();
  desc.handle.assign(p->handle()->begin(), p->handle()->end());
  desc.epoch = p->epoch();

  std::shared_ptr<PoolMapping> m;
  {
    std::lock_guard lock(mu);
    if (mapping && mapping->descriptor().epoch == desc.epoch) m = mapping;
  }
  // The same pool is mapped only once per process (CUDA refuses to open one
  // IPC handle twice); a new pool means the coordinator restarted.
  if (!m) m = map_pool(desc);
  {
    std::lock_guard lock(mu);
    session = ack->session();
    ++epoch;
    connected = true;
    mapping = std::move(m);
    heartbeat_interval = std::chrono::milliseconds(std::max<uint32_t>(ack->heartbeat_interval_ms(), 10));
    default_wait = std::chrono::milliseconds(ack->default_wait_ms());
  }
  conn.set_session(ack->session());
  cv.notify_all();
  spdlog::info("registered as '{}' with {} ({} pool of {} bytes on {})", opts.name, opts.endpoint,
               backend_name(desc.backend), desc.size, desc.device_name);
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
    case proto::Body::AssignJob: {
      const auto* a = r->body_as_AssignJob();
      if (!a->spec()) break;
      std::unique_ptr<proto::JobSpecT> spec(a->spec()->UnPack());
      flatbuffers::FlatBufferBuilder fbb;
      fbb.Finish(proto::JobSpec::Pack(fbb, spec.get()));
      std::vector<uint8_t> buf(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
      std::function<void(uint64_t, std::vector<uint8_t>)> cb;
      {
        std::lock_guard lock(mu);
        cb = on_assign;
      }
      if (cb) cb(a->job_id(), std::move(buf));
      break;
    }
    case proto::Body::StopJob: {
      std::function<void(uint64_t)> cb;
      {
        std::lock_guard lock(mu);
        cb = on_stop;
      }
      if (cb) cb(r->body_as_StopJob()->job_id());
      break;
    }
    default:
      break;
  }
}

void SessionCore::heartbeat_loop(std::unique_ptr<Connection> conn) {
  conn->on_notice = [this](const Reply& r) { handle_push(r); };
  auto last_ok = std::chrono::steady_clock::now();
  while (!stop.load()) {
    std::chrono::milliseconds interval;
    bool is_connected;
    {
      std::unique_lock lock(mu);
      interval = heartbeat_interval;
      is_connected = connected;
    }
    if (is_connected) {
      try {
        Reply r = conn->request(
            [](flatbuffers::FlatBufferBuilder& fbb) {
              return std::pair{proto::Body::Heartbeat, proto::CreateHeartbeat(fbb).Union()};
            },
            interval);
        if (r->body_type() == proto::Body::Error) {
          const auto* e = r->body_as_Error();
          if (e->code() == ErrorCode::UnknownSender) lose(std::string(str(e->message())));
        } else {
          last_ok = std::chrono::steady_clock::now();
        }
      } catch (const Error& e) {
        // The coordinator purges agents silent for two intervals; past that
        // our leases are gone whether or not it is still running.
        auto silent = std::chrono::steady_clock::now() - last_ok;
        if (silent > 2 * interval) {
          lose("no heartbeat reply for " +
               std::to_string(
                   std::chrono::duration_cast<std::chrono::milliseconds>(silent).count()) +
               " ms");
        }
        continue;  // the request already waited one interval
      }
    } else {
      try {
        register_with(*conn, std::max(interval, std::chrono::milliseconds(500)));
        last_ok = std::chrono::steady_clock::now();
        notify_listener("");
      } catch (const std::exception& e) {
        spdlog::debug("registration attempt failed: {}", e.what());
      }
    }
    // Until the next heartbeat, take what the coordinator pushes (jobs).
    auto next = std::chrono::steady_clock::now() + interval;
    while (!stop.load()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          next - std::chrono::steady_clock::now());
      if (left.count() <= 0) break;
      if (auto pushed = conn->receive(std::min(left, std::chrono::milliseconds(100)))) {
        if ((*pushed)->header()->request_id() == 0) handle_push(*pushed);
      }
    }
  }
}

// Sends a control request with the current session token. Throws Error.
Reply control_request(SessionCore& core, const Connection::BodyBuilder& build,
                      std::chrono::milliseconds timeout, uint64_t* epoch_out) {
  uint64_t session, epoch;
  {
    std::lock_guard lock(core.mu);
    if (!core.connected) {
      throw Error(ErrorCode::UnknownSender, "agent '" + core.opts.name +
                                                "' is not registered with the coordinator at " +
                                                core.opts.endpoint +
                                                " right now (it restarted or is unreachable)");
    }
    session = core.session;
    epoch = core.epoch;
  }
  if (epoch_out) *epoch_out = epoch;
  std::lock_guard lock(core.control_mu);
  core.control->set_session(session);
  Reply r = core.control->request(build, timeout);
  r.throw_if_error();
  return r;
}

void release_lease(SessionCore& core, uint64_t id) {
  control_request(
      core,
      [id](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::LeaseRelease, proto::CreateLeaseRelease(fbb, id).Union()};
      },
      core.opts.request_timeout, nullptr);
}

}  // namespace detail

// ---- Lease ----

Lease::Lease(Lease&& o) noexcept { *this = std::move(o); }

Lease& Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    reset();
    core_ = std::move(o.core_);
    mapping_ = std::move(o.mapping_);
    epoch_ = o.epoch_;
    id_ = o.id_;
    offset_ = o.offset_;
    size_ = o.size_;
    generation_ = o.generation_;
    end_ = o.end_;
    o.core_.reset();
  }
  return *this;
}

Lease::~Lease() { reset(); }

void Lease::reset() noexcept {
  if (!core_) return;
  if (!lost()) {
    try {
      detail::release_lease(*core_, id_);
    } catch (const std::exception& e) {
      spdlog::warn("could not release lease {} on destruction: {}", id_, e.what());
    }
  }
  core_.reset();
  mapping_.reset();
}

Backend Lease::backend() const {
  return mapping_ ? mapping_->descriptor().backend : Backend::Host;
}

int Lease::device() const { return mapping_ ? mapping_->descriptor().device : 0; }

bool Lease::lost() const {
  if (!core_) return false;
  std::lock_guard lock(core_->mu);
  return !core_->connected || core_->epoch != epoch_;
}

std::byte* Lease::data() const {
  if (!core_) throw Error(ErrorCode::NoSuchLease, "lease is not held");
  if (lost()) {
    throw Error(ErrorCode::NoSuchLease,
                "lease " + std::to_string(id_) + " was lost with the coordinator session");
  }
  return mapping_->base() + offset_;
}

// ---- AgentSession ----

AgentSession::AgentSession(AgentOptions opts)
    : core_(std::make_shared<detail::SessionCore>(std::move(opts))) {
  auto& c = *core_;
  c.control = std::make_unique<Connection>(c.ctx, c.opts.endpoint, c.opts.name);
  c.control->on_notice = [core = core_.get()](const Reply& r) {
    if (r->body_type() == proto::Body::Shutdown) core->lose("the coordinator shut down");
  };
  auto hb = std::make_unique<Connection>(c.ctx, c.opts.endpoint, c.opts.name);
  auto deadline = std::chrono::steady_clock::now() + c.opts.register_timeout;
  while (true) {
    try {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      c.register_with(*hb, std::clamp(left, std::chrono::milliseconds(1), c.opts.request_timeout));
      break;
    } catch (const Error& e) {
      bool retry = e.code() == ErrorCode::Timeout || e.code() == ErrorCode::NameTaken;
      if (!retry || std::chrono::steady_clock::now() >= deadline) {
        throw Error(e.code(), "agent '" + c.opts.name + "' could not register: " + e.what());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  c.heartbeat = std::thread([core = core_.get(), conn = std::move(hb)]() mutable {
    core->heartbeat_loop(std::move(conn));
  });
}

AgentSession::~AgentSession() {
  auto& c = *core_;
  c.stop.store(true);
  c.cv.notify_all();
  if (c.heartbeat.joinable()) c.heartbeat.join();
  try {
    detail::control_request(
        c,
        [](flatbuffers::FlatBufferBuilder& fbb) {
          return std::pair{proto::Body::Unregister, proto::CreateUnregister(fbb).Union()};
        },
        std::chrono::milliseconds(1000), nullptr);
  } catch (const std::exception& e) {
    spdlog::debug("unregister: {}", e.what());
  }
  std::lock_guard lock(c.mu);
  c.connected = false;  // leases still alive elsewhere now report lost()
}

Lease AgentSession::acquire(uint64_t size, LeaseEnd end, std::optional<std::chrono::milliseconds> wait) {
  std::chrono::milliseconds default_wait;
  {
    std::lock_guard lock(core_->mu);
    default_wait = core_->default_wait;
  }
  int32_t wait_ms = wait ? static_cast<int32_t>(std::min<int64_t>(wait->count(), INT32_MAX)) : -1;
  auto timeout = (wait ? *wait : default_wait) + core_->opts.request_timeout;
  uint64_t epoch = 0;
  Reply r = detail::control_request(
      *core_,
      [&](flatbuffers::FlatBufferBuilder& fbb) {
        auto e = end == LeaseEnd::High ? proto::LeaseEnd::High : proto::LeaseEnd::Low;
        return std::pair{proto::Body::LeaseRequest,
                         proto::CreateLeaseRequest(fbb, size, e, wait_ms).Union()};
      },
      timeout, &epoch);
  const auto* grant = r->body_as_LeaseGrant();
  if (!grant || !grant->lease()) {
    throw Error(ErrorCode::Malformed, std::string("expected LeaseGrant, got ") +
                                          proto::EnumNameBody(r->body_type()));
  }
  Lease lease;
  lease.core_ = core_;
  {
    std::lock_guard lock(core_->mu);
    lease.mapping_ = core_->mapping;
  }
  lease.epoch_ = epoch;
  lease.id_ = grant->lease()->id();
  lease.offset_ = grant->lease()->offset();
  lease.size_ = grant->lease()->size();
  lease.generation_ = grant->lease()->generation();
  lease.end_ = end;
  if (lease.offset_ + lease.size_ > lease.mapping_->descriptor().size || lease.size_ < size) {
    throw Error(ErrorCode::Malformed, "coordinator granted a lease outside the pool");
  }
  return lease;
}

void AgentSession::resize(Lease& lease, uint64_t size) {
  if (!lease.held()) throw Error(ErrorCode::NoSuchLease, "lease is not held");
  uint64_t id = lease.id_;
  Reply r = detail::control_request(
      *core_,
      [&](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::LeaseResize, proto::CreateLeaseResize(fbb, id, size).Union()};
      },
      core_->opts.request_timeout, nullptr);
  const auto* grant = r->body_as_LeaseGrant();
  if (!grant || !grant->lease()) throw Error(ErrorCode::Malformed, "expected LeaseGrant");
  lease.size_ = grant->lease()->size();
  lease.generation_ = grant->lease()->generation();
}

void AgentSession::release(Lease& lease) {
  if (!lease.held()) throw Error(ErrorCode::NoSuchLease, "lease is not held");
  if (!lease.lost()) detail::release_lease(*core_, lease.id_);
  lease.core_.reset();
  lease.mapping_.reset();
}

PoolDescriptor AgentSession::pool() const {
  std::lock_guard lock(core_->mu);
  return core_->mapping->descriptor();
}

const std::string& AgentSession::name() const { return core_->opts.name; }

uint64_t AgentSession::registrations() const {
  std::lock_guard lock(core_->mu);
  return core_->epoch;
}

bool AgentSession::connected() const {
  std::lock_guard lock(core_->mu);
  return core_->connected;
}

bool AgentSession::wait_connected(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(core_->mu);
  return core_->cv.wait_for(lock, timeout, [&] { return core_->connected; });
}

void AgentSession::set_job_handlers(std::function<void(uint64_t, std::vector<uint8_t>)> on_assign,
                                    std::function<void(uint64_t)> on_stop) {
  std::lock_guard lock(core_->mu);
  core_->on_assign = std::move(on_assign);
  core_->on_stop = std::move(on_stop);
}

void AgentSession::send_job_update(const proto::JobUpdateT& update) {
  detail::control_request(
      *core_,
      [&](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::JobUpdate, proto::JobUpdate::Pack(fbb, &update).Union()};
      },
      core_->opts.request_timeout, nullptr);
}

void AgentSession::set_session_listener(std::function<void(const std::string&)> listener) {
  std::lock_guard lock(core_->mu);
  core_->listener = std::move(listener);
}

}  // namespace leasehold
