#include "lease_client/session.h"

#include <spdlog/spdlog.h>

#include <mutex>
#include <stdexcept>
#include <thread>

#include "lease_client/session_core.h"
#include "shared/protocol.h"

namespace leasehold {

// ---- Lease ----

Lease::Lease(Lease&& o) noexcept { *this = std::move(o); }

Lease& Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    reset();
    hold_ = std::move(o.hold_);
    id_ = o.id_;
    offset_ = o.offset_;
    size_ = o.size_;
    generation_ = o.generation_;
    end_ = o.end_;
  }
  return *this;
}

Lease::~Lease() { reset(); }

void Lease::reset() noexcept {
  if (!hold_.held()) return;
  hold_.unmap();
  if (!hold_.lost()) {
    try {
      detail::release_lease(*hold_.core, id_);
    } catch (const std::exception& e) {
      spdlog::warn("could not release lease {} on destruction: {}", id_, e.what());
    }
  }
  hold_.clear();
}

std::byte* Lease::data() const {
  return hold_.at(offset_, ErrorCode::NoSuchLease, "lease " + std::to_string(id_));
}

void Lease::release() {
  if (!hold_.held()) throw Error(ErrorCode::NoSuchLease, "lease is not held");
  // Given up whatever the answer: releasing twice could take a lease that
  // the coordinator handed out again under the same id.
  detail::PoolHold hold = std::move(hold_);
  hold.unmap();
  if (!hold.lost()) detail::release_lease(*hold.core, id_);
}

// ---- RegionAttachment ----

RegionAttachment::RegionAttachment(RegionAttachment&& o) noexcept { *this = std::move(o); }

RegionAttachment& RegionAttachment::operator=(RegionAttachment&& o) noexcept {
  if (this != &o) {
    reset();
    hold_ = std::move(o.hold_);
    name_ = std::move(o.name_);
    offset_ = o.offset_;
    size_ = o.size_;
    must_fill_ = o.must_fill_;
  }
  return *this;
}

RegionAttachment::~RegionAttachment() { reset(); }

void RegionAttachment::reset() noexcept {
  if (!hold_.held()) return;
  hold_.unmap();
  if (!hold_.lost()) {
    try {
      detail::control_request(*hold_.core, detail::detach_body(name_),
                              hold_.core->opts.request_timeout, nullptr);
    } catch (const std::exception& e) {
      spdlog::warn("could not detach from region '{}': {}", name_, e.what());
    }
  }
  hold_.clear();
}

std::byte* RegionAttachment::data() const {
  return hold_.at(offset_, ErrorCode::NoSuchRegion, "region '" + name_ + "'");
}

void RegionAttachment::mark_ready() {
  if (!hold_.held()) throw Error(ErrorCode::NoSuchRegion, "region attachment is not held");
  if (!must_fill_) throw Error(ErrorCode::NotOwner, "region '" + name_ + "' is not ours to fill");
  const std::string name = name_;
  detail::control_request(
      *hold_.core,
      [&](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::RegionReady,
                         proto::CreateRegionReady(fbb, fbb.CreateString(name)).Union()};
      },
      hold_.core->opts.request_timeout, nullptr);
  must_fill_ = false;
  // Filled: from now on nobody writes it, its filler neither.
  hold_.narrow();
}

void RegionAttachment::detach() {
  if (!hold_.held()) throw Error(ErrorCode::NoSuchRegion, "region attachment is not held");
  // Given up whatever the answer: detaching twice could take another
  // attachment of this agent to the same region.
  detail::PoolHold hold = std::move(hold_);
  hold.unmap();
  if (!hold.lost()) {
    detail::control_request(*hold.core, detail::detach_body(name_),
                            hold.core->opts.request_timeout, nullptr);
  }
}

// ---- AgentSession ----

AgentSession::AgentSession(AgentOptions opts)
    : core_(std::make_shared<detail::SessionCore>(std::move(opts))) {
  auto& c = *core_;
  c.control = std::make_unique<Connection>(c.ctx, c.opts.endpoint, c.opts.name, c.opts.curve);
  c.control->on_notice = [core = core_.get()](const Reply& r) {
    if (r->body_type() == proto::Body::Shutdown) core->lose("the coordinator shut down");
  };
  c.control->on_late_reply = [core = core_.get()](const Reply& r) { core->note_late_reply(r); };
  auto hb = std::make_unique<Connection>(c.ctx, c.opts.endpoint, c.opts.name, c.opts.curve);
  auto deadline = std::chrono::steady_clock::now() + c.opts.register_timeout;
  while (true) {
    try {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      c.register_with(*hb, std::clamp(left, std::chrono::milliseconds(1), c.opts.request_timeout));
      break;
    } catch (const Error& e) {
      bool retry = e.code() == ErrorCode::Timeout || e.code() == ErrorCode::NameTaken;
      if (c.opts.interrupt && c.opts.interrupt->load()) {
        throw Error(ErrorCode::Interrupted,
                    "agent '" + c.opts.name + "' stopped before it registered: " + e.what());
      }
      if (!retry || std::chrono::steady_clock::now() >= deadline) {
        throw Error(e.code(), "agent '" + c.opts.name + "' could not register: " + e.what());
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    } catch (const std::exception& e) {
      // The pool's range could not be reserved (the device's context
      // could not be made, say, as when the coordinator's GPU is not
      // visible yet): ask again until the deadline.
      if (std::chrono::steady_clock::now() >= deadline) {
        throw Error(ErrorCode::Internal,
                    "agent '" + c.opts.name + "' could not register: " + e.what());
      }
      spdlog::warn("{}; registering again", e.what());
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
  // Leases and attachments that outlive the session lose their memory
  // first: once unregistered, the coordinator hands it to others.
  std::shared_ptr<PoolMapping> mapping;
  {
    std::lock_guard lock(c.mu);
    if (auto it = c.holds.find(c.epoch); it != c.holds.end() && it->second > 0) mapping = c.mapping;
  }
  if (mapping) mapping->unmap_all();
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

Lease AgentSession::acquire(uint64_t size, LeaseEnd end, std::optional<std::chrono::milliseconds> wait,
                            bool needed) {
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
                         proto::CreateLeaseRequest(fbb, size, e, wait_ms, needed).Union()};
      },
      timeout, &epoch, /*grants_lease=*/true);
  const auto* grant = r->body_as_LeaseGrant();
  if (!grant || !grant->lease()) {
    throw Error(ErrorCode::Malformed, std::string("expected LeaseGrant, got ") +
                                          proto::EnumNameBody(r->body_type()));
  }
  Lease lease;
  lease.hold_ = detail::PoolHold(core_, current_mapping(), epoch);
  lease.id_ = grant->lease()->id();
  lease.offset_ = grant->lease()->offset();
  lease.size_ = grant->lease()->size();
  lease.generation_ = grant->lease()->generation();
  lease.end_ = end;
  const uint64_t chunk = lease.hold_.mapping->descriptor().alignment;
  if (lease.offset_ + lease.size_ > lease.hold_.mapping->descriptor().size || lease.size_ < size ||
      lease.offset_ % chunk != 0 || lease.size_ % chunk != 0) {
    throw Error(ErrorCode::Malformed, "coordinator granted a lease outside the pool");
  }
  ChunkRequest req;
  req.kind = ChunkRequest::Kind::Lease;
  req.lease_id = lease.id_;
  // On failure the Lease's destructor gives it back.
  lease.hold_.map(req, lease.offset_ / chunk, lease.size_ / chunk, ErrorCode::Internal,
                  "lease " + std::to_string(lease.id_));
  return lease;
}

RegionAttachment AgentSession::attach_region(const std::string& name, uint64_t size, bool create,
                                             std::optional<std::chrono::milliseconds> wait,
                                             bool replace) {
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
        return std::pair{proto::Body::AttachRegion,
                         proto::CreateAttachRegion(fbb, fbb.CreateString(name), size, create,
                                                   replace, wait_ms)
                             .Union()};
      },
      timeout, &epoch, /*grants_lease=*/true);
  const auto* grant = r->body_as_RegionGrant();
  if (!grant || !grant->region()) {
    throw Error(ErrorCode::Malformed, std::string("expected RegionGrant, got ") +
                                          proto::EnumNameBody(r->body_type()));
  }
  RegionAttachment a;
  a.hold_ = detail::PoolHold(core_, current_mapping(), epoch);
  a.name_ = name;
  a.offset_ = grant->region()->offset();
  a.size_ = grant->region()->size();
  a.must_fill_ = grant->fill();
  const uint64_t chunk = a.hold_.mapping->descriptor().alignment;
  if (a.offset_ + a.size_ > a.hold_.mapping->descriptor().size || (size && a.size_ != size) ||
      a.offset_ % chunk != 0) {
    throw Error(ErrorCode::Malformed, "coordinator granted region '" + name +
                                          "' outside the pool or of another size");
  }
  ChunkRequest req;
  req.kind = ChunkRequest::Kind::Region;
  req.region = name;
  // On failure the attachment's destructor detaches.
  a.hold_.map(req, a.offset_ / chunk, (a.size_ + chunk - 1) / chunk, ErrorCode::Internal,
              "region '" + name + "'");
  return a;
}

void AgentSession::set_ready(bool ready, uint64_t outside_pool_bytes) {
  {
    std::lock_guard lock(core_->mu);
    core_->ready = ready;
    core_->outside_pool_bytes = outside_pool_bytes;
  }
  heartbeat_soon();
}

void AgentSession::resize(Lease& lease, uint64_t size) {
  if (!lease.held()) throw Error(ErrorCode::NoSuchLease, "lease is not held");
  const uint64_t id = lease.id_;
  const uint64_t chunk = lease.hold_.mapping->descriptor().alignment;
  ChunkRequest req;
  req.kind = ChunkRequest::Kind::Lease;
  req.lease_id = id;
  const std::string what = "lease " + std::to_string(id);
  // A shrink gives up the tail: out of reach before the coordinator hears.
  const uint64_t keep = std::min(lease.hold_.chunk_count, (size + chunk - 1) / chunk);
  lease.hold_.unmap(keep);
  Reply r;
  try {
    r = detail::control_request(
        *core_,
        [&](flatbuffers::FlatBufferBuilder& fbb) {
          return std::pair{proto::Body::LeaseResize,
                           proto::CreateLeaseResize(fbb, id, size).Union()};
        },
        core_->opts.request_timeout, nullptr);
  } catch (...) {
    // Refused (or no answer): the lease is as it was; its tail back in
    // reach where it can be, and the size what is mapped.
    if (!lease.lost()) {
      try {
        lease.hold_.map(req, lease.offset_ / chunk, lease.size_ / chunk, ErrorCode::Internal, what);
      } catch (const std::exception& e) {
        spdlog::warn("{}: {}", what, e.what());
      }
    }
    lease.size_ = std::min(lease.size_, lease.hold_.chunk_count * chunk);
    throw;
  }
  const auto* grant = r->body_as_LeaseGrant();
  if (!grant || !grant->lease()) throw Error(ErrorCode::Malformed, "expected LeaseGrant");
  if (grant->lease()->offset() != lease.offset_ || grant->lease()->size() % chunk != 0) {
    throw Error(ErrorCode::Malformed, "coordinator moved " + what + " when resizing it");
  }
  const uint64_t granted = grant->lease()->size();
  lease.generation_ = grant->lease()->generation();
  lease.hold_.unmap(granted / chunk);
  lease.size_ = lease.hold_.chunk_count * chunk;
  // Grown in place: the new chunks. The size counts them once mapped (a
  // failure leaves the lease as large as what this process can reach; the
  // coordinator's larger lease goes back whole on release).
  lease.hold_.map(req, lease.offset_ / chunk, granted / chunk, ErrorCode::Internal, what);
  lease.size_ = granted;
}

void AgentSession::release(Lease& lease) { lease.release(); }

PoolDescriptor AgentSession::pool() const {
  std::lock_guard lock(core_->mu);
  return core_->mapping->descriptor();
}

std::byte* AgentSession::pool_base() const {
  std::lock_guard lock(core_->mu);
  return core_->mapping->base();
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

SessionToken AgentSession::session_token() const {
  std::lock_guard lock(core_->mu);
  return core_->connected ? core_->session : SessionToken{};
}

std::shared_ptr<PoolMapping> AgentSession::current_mapping() const {
  std::lock_guard lock(core_->mu);
  return core_->mapping;
}

bool AgentSession::may_touch() const {
  std::lock_guard lock(core_->mu);
  return core_->may_touch_locked(std::chrono::steady_clock::now());
}

bool AgentSession::wait_may_touch(const std::function<bool()>& give_up) const {
  std::unique_lock lock(core_->mu);
  while (core_->connected && !core_->may_touch_locked(std::chrono::steady_clock::now())) {
    lock.unlock();
    if (give_up && give_up()) return false;
    lock.lock();
    core_->cv.wait_for(lock, std::chrono::milliseconds(50));
  }
  return core_->connected;
}

bool AgentSession::wait_connected(std::chrono::milliseconds timeout) const {
  std::unique_lock lock(core_->mu);
  return core_->cv.wait_for(lock, timeout, [&] { return core_->connected; });
}

void AgentSession::set_jobs_provider(std::function<std::vector<proto::AgentJobT>()> jobs) {
  std::lock_guard lock(core_->handlers_mu);
  core_->jobs_provider = std::move(jobs);
}

void AgentSession::set_push_handler(std::function<void(const proto::Envelope&)> on_push) {
  std::lock_guard lock(core_->handlers_mu);
  core_->on_push = std::move(on_push);
}

void AgentSession::set_shrink_handler(std::function<void(const proto::ShrinkT&)> on_shrink) {
  std::lock_guard lock(core_->handlers_mu);
  core_->on_shrink = std::move(on_shrink);
}

void AgentSession::send_shrink_done(uint64_t id, uint64_t released, uint64_t leased,
                                    const std::string& reason) {
  proto::ShrinkDoneT done;
  done.id = id;
  done.released = released;
  done.leased = leased;
  done.reason = reason;
  detail::control_request(
      *core_,
      [&](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::ShrinkDone, proto::ShrinkDone::Pack(fbb, &done).Union()};
      },
      core_->opts.request_timeout, nullptr);
}

void AgentSession::heartbeat_soon() { core_->heartbeat_due.store(true); }

Reply AgentSession::request(const Connection::BodyBuilder& build,
                            std::optional<std::chrono::milliseconds> timeout) {
  return detail::control_request(*core_, build, timeout.value_or(core_->opts.request_timeout),
                                 nullptr);
}

void AgentSession::set_session_listener(std::function<void(const std::string&)> listener) {
  std::lock_guard lock(core_->handlers_mu);
  core_->listener = std::move(listener);
}

}  // namespace leasehold
