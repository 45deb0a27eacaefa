#include "coordinator/coordinator.h"

#include <signal.h>
#include <spdlog/spdlog.h>

#include <cctype>
#include <cerrno>
#include <filesystem>
#include <random>

#include "coordinator/replies.h"
#include "shared/connection.h"
#include "shared/endpoint.h"
#include "shared/units.h"

namespace leasehold {
namespace {

constexpr size_t kMaxNameLength = 128;
// A client may ask to wait at most this long for a lease.
constexpr std::chrono::hours kMaxLeaseWait{24};
// Time a newly registered agent has before its first heartbeat: it maps the
// pool first, and creating a CUDA context plus cudaIpcOpenMemHandle can take
// seconds when many agents start at once (seen: 32 agents on one H200). After
// the first heartbeat the two-interval rule applies.
constexpr std::chrono::seconds kFirstHeartbeatGrace{30};

bool valid_name(std::string_view name) {
  if (name.empty() || name.size() > kMaxNameLength) return false;
  for (char c : name) {
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_' || c == '.' ||
          c == '@' || c == ':')) {
      return false;
    }
  }
  return true;
}

// True when a process with `pid` certainly no longer exists on this host.
bool process_gone(int pid) { return pid > 0 && kill(pid, 0) != 0 && errno == ESRCH; }

// Refuses to start when another coordinator answers at `endpoint`: binding an
// ipc:// endpoint would silently take its socket away.
void ensure_no_live_coordinator(zmq::context_t& ctx, const std::string& endpoint) {
  auto path = ipc_path(endpoint);
  if (path && !std::filesystem::exists(*path)) return;
  Connection probe(ctx, endpoint, "leasehold-coordinator-probe");
  try {
    probe.request(
        [](flatbuffers::FlatBufferBuilder& fbb) {
          return std::pair{proto::Body::StatusRequest, proto::CreateStatusRequest(fbb).Union()};
        },
        std::chrono::milliseconds(300));
  } catch (const Error&) {
    if (path) spdlog::info("replacing stale socket {} left by an earlier run", *path);
    return;
  }
  throw std::runtime_error("another leasehold-coordinator is already serving at " + endpoint);
}

PoolAllocator::End to_end(proto::LeaseEnd e) {
  return e == proto::LeaseEnd::High ? PoolAllocator::End::High : PoolAllocator::End::Low;
}

}  // namespace

Coordinator::Coordinator(const CoordinatorOptions& opts)
    : opts_(opts),
      ctx_(1),
      router_(ctx_, zmq::socket_type::router),
      pub_(ctx_, zmq::socket_type::pub),
      started_(Clock::now()) {
  std::random_device rd;
  next_session_ = (static_cast<uint64_t>(rd()) << 32) | rd();

  prepare_ipc_directory(opts_.endpoint);
  ensure_no_live_coordinator(ctx_, opts_.endpoint);

  Backend backend = resolve_backend(opts_.backend);
  DeviceMemory mem = query_device_memory(backend, opts_.device);
  uint64_t size = align_down(opts_.pool_size.resolve(mem.free_bytes), opts_.alignment);
  if (size == 0) {
    throw std::runtime_error("pool size " + opts_.pool_size.to_string() + " of " +
                             format_bytes(mem.free_bytes) + " free on " + mem.name +
                             " is less than one aligned block of " +
                             format_bytes(opts_.alignment));
  }
  if (opts_.pool_size.percent == 0 && size > mem.free_bytes) {
    throw std::runtime_error("pool size " + format_bytes(size) + " exceeds the " +
                             format_bytes(mem.free_bytes) + " free on " + mem.name);
  }
  pool_ = create_pool(backend, opts_.device, size, opts_.alignment, opts_.endpoint);
  leases_ = std::make_unique<LeaseTable>(size, opts_.alignment);

  router_.set(zmq::sockopt::linger, 0);
  router_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxMessageBytes));
  try {
    router_.bind(opts_.endpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error("cannot bind " + opts_.endpoint + ": " + e.what());
  }
  pub_.set(zmq::sockopt::linger, 0);
  try {
    prepare_ipc_directory(opts_.events_endpoint);
    pub_.bind(opts_.events_endpoint);
  } catch (const zmq::error_t& e) {
    throw std::runtime_error("cannot bind the events endpoint " + opts_.events_endpoint + ": " +
                             e.what());
  }
  spdlog::info("pool: {} of {} on {} ({}, device {}), alignment {}; listening on {}",
               format_bytes(size), format_bytes(mem.free_bytes), mem.name,
               backend_name(backend), opts_.device, format_bytes(opts_.alignment),
               opts_.endpoint);
}

// ZeroMQ's ipc listener unlinks its socket file when the socket closes.
Coordinator::~Coordinator() = default;

std::string Coordinator::summary() const {
  const auto& a = leases_->allocator();
  return std::to_string(agents_.size()) + " agents, " + std::to_string(leases_->leases().size()) +
         " leases, " + format_bytes(a.used_bytes()) + " of " + format_bytes(a.pool_size()) +
         " leased";
}

void Coordinator::run(const std::atomic<bool>& stop, const std::function<void()>& tick_fn) {
  // Wake often enough to purge dead agents well within three intervals.
  const auto tick = std::max(std::chrono::milliseconds(5), opts_.heartbeat_interval / 4);
  while (!stop.load()) {
    auto timeout = tick;
    if (auto d = leases_->next_deadline()) {
      auto until = std::chrono::duration_cast<std::chrono::milliseconds>(*d - Clock::now());
      timeout = std::clamp(until + std::chrono::milliseconds(1), std::chrono::milliseconds(0),
                           tick);
    }
    zmq::pollitem_t item{router_.handle(), 0, ZMQ_POLLIN, 0};
    try {
      zmq::poll(&item, 1, timeout);
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;
    }
    // Drain everything that arrived before doing housekeeping.
    for (int i = 0; i < 1024 && (item.revents & ZMQ_POLLIN); ++i) {
      std::vector<zmq::message_t> frames;
      zmq::message_t frame;
      bool got = false;
      try {
        got = router_.recv(frame, zmq::recv_flags::dontwait).has_value();
        while (got) {
          bool more = frame.more();
          frames.push_back(std::move(frame));
          if (!more) break;
          got = router_.recv(frame, zmq::recv_flags::none).has_value();
        }
      } catch (const zmq::error_t& e) {
        if (e.num() == EINTR) continue;
        throw;
      }
      if (frames.empty()) break;
      std::string rid = frames[0].to_string();
      if (frames.size() != 2) {
        spdlog::warn("rejected a message of {} frames (expected one)", frames.size() - 1);
        reply_error(rid, 0, ErrorCode::Malformed,
                    "expected a single-frame message, got " + std::to_string(frames.size() - 1) +
                        " frames");
        continue;
      }
      handle(rid, frames[1]);
    }
    auto now = Clock::now();
    purge_dead_agents(now);
    for (auto& e : leases_->expire(now)) {
      reply_error(e.reply_to.routing_id, e.reply_to.request_id, e.refusal.code,
                  e.refusal.message);
    }
    if (tick_fn) tick_fn();
  }
  spdlog::info("stopping: telling {} agents", agents_.size());
  for (const auto& [name, agent] : agents_) {
    flatbuffers::FlatBufferBuilder fbb;
    auto reason = fbb.CreateString("coordinator is shutting down");
    finish_envelope(fbb, {0, "coordinator", 0}, proto::Body::Shutdown,
                    proto::CreateShutdown(fbb, reason).Union());
    for (const auto& rid : agent.routing_ids) reply(rid, to_message(fbb));
  }
}

void Coordinator::reply(const std::string& routing_id, zmq::message_t&& msg) {
  try {
    router_.send(zmq::buffer(routing_id), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    router_.send(msg, zmq::send_flags::dontwait);
  } catch (const zmq::error_t& e) {
    spdlog::warn("could not send a reply: {}", e.what());
  }
}

void Coordinator::reply_error(const std::string& rid, uint64_t request_id, ErrorCode code,
                              const std::string& message) {
  reply(rid, make_error({request_id, "coordinator", 0}, code, message));
}

void Coordinator::reply_lease(const std::string& rid, uint64_t request_id,
                              const LeaseRecord& rec) {
  flatbuffers::FlatBufferBuilder fbb(256);
  auto lease = build_lease(fbb, rec);
  finish_envelope(fbb, {request_id, "coordinator", 0}, proto::Body::LeaseGrant,
                  proto::CreateLeaseGrant(fbb, lease).Union());
  reply(rid, to_message(fbb));
}

void Coordinator::reply_ack(const std::string& rid, uint64_t request_id, proto::Body type) {
  flatbuffers::FlatBufferBuilder fbb(128);
  flatbuffers::Offset<void> body = type == proto::Body::HeartbeatAck
                                       ? proto::CreateHeartbeatAck(fbb).Union()
                                       : proto::CreateAck(fbb).Union();
  finish_envelope(fbb, {request_id, "coordinator", 0}, type, body);
  reply(rid, to_message(fbb));
}

void Coordinator::handle(const std::string& routing_id, zmq::message_t& payload) {
  AlignedBytes bytes(payload);
  auto decoded = decode(bytes.bytes());
  if (auto* err = std::get_if<DecodeError>(&decoded)) {
    spdlog::warn("rejected a message of {} bytes: {}", payload.size(), err->message);
    // Echo the request id when the header can be trusted enough to read it.
    uint64_t request_id = 0;
    if (err->code == ErrorCode::BadVersion) {
      request_id = proto::GetEnvelope(bytes.bytes().data())->header()->request_id();
    }
    reply_error(routing_id, request_id, err->code, err->message);
    return;
  }
  try {
    dispatch(routing_id, *std::get<const proto::Envelope*>(decoded));
  } catch (const std::exception& e) {
    // A bug or a resource failure while serving one request must not take the
    // coordinator down; the peer learns what happened.
    spdlog::error("internal error while serving a request: {}", e.what());
    reply_error(routing_id, std::get<const proto::Envelope*>(decoded)->header()->request_id(),
                ErrorCode::Internal, std::string("internal error: ") + e.what());
  }
}

void Coordinator::dispatch(const std::string& rid, const proto::Envelope& env) {
  const auto* hdr = env.header();
  uint64_t req = hdr->request_id();
  switch (env.body_type()) {
    case proto::Body::Register:
      return on_register(rid, env);
    case proto::Body::StatusRequest:
      return on_status(rid, env);
    case proto::Body::SubmitJob:
      return on_submit(rid, env);
    case proto::Body::ListJobs:
      return on_list_jobs(rid, env);
    case proto::Body::GetJob:
      return on_get_job(rid, env);
    case proto::Body::CancelJob:
      return on_cancel(rid, env);
    case proto::Body::JobUpdate:
    case proto::Body::Heartbeat:
    case proto::Body::Unregister:
    case proto::Body::LeaseRequest:
    case proto::Body::LeaseResize:
    case proto::Body::LeaseRelease:
      break;
    default:
      return reply_error(rid, req, ErrorCode::Malformed,
                         std::string("message type ") +
                             proto::EnumNameBody(env.body_type()) +
                             " is not a request the coordinator serves");
  }

  // Everything below needs a registered agent presenting its session token.
  std::string name(str(hdr->sender()));
  auto it = agents_.find(name);
  if (it == agents_.end() || it->second.session != hdr->session()) {
    return reply_error(rid, req, ErrorCode::UnknownSender,
                       "agent '" + name +
                           "' is not registered with this coordinator (it may have restarted); "
                           "register first");
  }
  AgentRecord& agent = it->second;
  agent.last_seen = Clock::now();
  if (agent.routing_ids.insert(rid).second && agent.routing_ids.size() > 4) {
    agent.routing_ids.erase(agent.routing_ids.begin());
  }

  switch (env.body_type()) {
    case proto::Body::Heartbeat:
      return reply_ack(rid, req, proto::Body::HeartbeatAck);
    case proto::Body::Unregister:
      drop_agent(name, "unregistered");
      reply_ack(rid, req, proto::Body::Ack);
      return serve_waiting();
    case proto::Body::LeaseRequest:
      return on_lease_request(rid, agent, env);
    case proto::Body::JobUpdate:
      return on_job_update(rid, agent, env);
    case proto::Body::LeaseResize: {
      const auto* r = env.body_as_LeaseResize();
      auto result = leases_->resize(name, r->lease_id(), r->size());
      if (auto* refusal = std::get_if<Refusal>(&result)) {
        return reply_error(rid, req, refusal->code, refusal->message);
      }
      reply_lease(rid, req, std::get<LeaseRecord>(result));
      return serve_waiting();
    }
    case proto::Body::LeaseRelease: {
      const auto* r = env.body_as_LeaseRelease();
      if (auto refusal = leases_->release(name, r->lease_id())) {
        return reply_error(rid, req, refusal->code, refusal->message);
      }
      reply_ack(rid, req, proto::Body::Ack);
      return serve_waiting();
    }
    default:
      return;
  }
}

void Coordinator::on_register(const std::string& rid, const proto::Envelope& env) {
  const auto* r = env.body_as_Register();
  uint64_t req = env.header()->request_id();
  std::string name(str(r->name()));
  if (!valid_name(name)) {
    return reply_error(rid, req, ErrorCode::InvalidArgument,
                       "agent name '" + name.substr(0, kMaxNameLength) +
                           "' is invalid: use 1-128 letters, digits, '-', '_', '.', '@' or ':'");
  }
  if (r->pid() <= 0) {
    return reply_error(rid, req, ErrorCode::InvalidArgument,
                       "pid " + std::to_string(r->pid()) + " is invalid");
  }
  if (r->device() >= 0 && r->device() != pool().device) {
    return reply_error(rid, req, ErrorCode::InvalidArgument,
                       "agent wants device " + std::to_string(r->device()) +
                           " but this coordinator's pool is on device " +
                           std::to_string(pool().device));
  }
  if (auto it = agents_.find(name); it != agents_.end()) {
    const AgentRecord& old = it->second;
    if (old.pid == r->pid()) {
      // The same process registering again lost its session (for example a
      // reply that never reached it): its old leases are void.
      drop_agent(name, "registered again");
    } else if (process_gone(old.pid)) {
      drop_agent(name, "replaced: its process is gone");
    } else {
      return reply_error(rid, req, ErrorCode::NameTaken,
                         "agent name '" + name + "' is in use by live pid " +
                             std::to_string(old.pid));
    }
    serve_waiting();
  }
  AgentRecord rec;
  rec.name = name;
  rec.pid = r->pid();
  rec.device = pool().device;
  rec.session = ++next_session_;
  rec.routing_ids.insert(rid);
  rec.registered = Clock::now();
  rec.last_seen = rec.registered + kFirstHeartbeatGrace;
  agents_[name] = rec;
  spdlog::info("agent '{}' (pid {}) registered; {}", name, rec.pid, summary());

  flatbuffers::FlatBufferBuilder fbb(512);
  auto pool_info = build_pool_info(fbb, pool());
  auto ack = proto::CreateRegisterAck(fbb, rec.session,
                                      static_cast<uint32_t>(opts_.heartbeat_interval.count()),
                                      pool_info,
                                      static_cast<uint32_t>(opts_.lease_wait_timeout.count()));
  finish_envelope(fbb, {req, "coordinator", 0}, proto::Body::RegisterAck, ack.Union());
  reply(rid, to_message(fbb));
  // A new standby agent may take a queued job (after it got its RegisterAck).
  schedule();
}

void Coordinator::on_lease_request(const std::string& rid, AgentRecord& agent,
                                   const proto::Envelope& env) {
  const auto* r = env.body_as_LeaseRequest();
  uint64_t req = env.header()->request_id();
  int64_t wait_ms = r->wait_ms() < 0 ? opts_.lease_wait_timeout.count() : r->wait_ms();
  wait_ms = std::min<int64_t>(wait_ms, std::chrono::milliseconds(kMaxLeaseWait).count());
  PendingRequest pending{agent.name, r->size(), to_end(r->end()),
                         Clock::now() + std::chrono::milliseconds(wait_ms), {rid, req}};
  auto outcome = leases_->request(pending, wait_ms > 0);
  if (auto* refusal = std::get_if<Refusal>(&outcome)) {
    spdlog::info("lease of {} for '{}' refused: {}", format_bytes(r->size()), agent.name,
                 refusal->message);
    return reply_error(rid, req, refusal->code, refusal->message);
  }
  if (std::holds_alternative<LeaseTable::Queued>(outcome)) {
    spdlog::info("lease of {} for '{}' waits up to {} ms for memory", format_bytes(r->size()),
                 agent.name, wait_ms);
    return;
  }
  const auto& rec = std::get<LeaseRecord>(outcome);
  spdlog::debug("lease {} granted to '{}': offset {} size {}", rec.id, agent.name, rec.offset,
                rec.size);
  reply_lease(rid, req, rec);
}

void Coordinator::serve_waiting() {
  for (const auto& g : leases_->grant_waiting()) {
    spdlog::info("waiting lease of {} granted to '{}' (lease {})", format_bytes(g.lease.size),
                 g.lease.owner, g.lease.id);
    reply_lease(g.reply_to.routing_id, g.reply_to.request_id, g.lease);
  }
}

void Coordinator::drop_agent(const std::string& name, const char* why) {
  fail_jobs_of(name, std::string("agent '") + name + "' " + why + " while running it");
  auto [count, bytes] = leases_->release_all(name);
  auto it = agents_.find(name);
  int pid = it != agents_.end() ? it->second.pid : 0;
  agents_.erase(name);
  spdlog::info("agent '{}' (pid {}) {}; reclaimed {} leases ({})", name, pid, why, count,
               format_bytes(bytes));
  schedule();
}

void Coordinator::purge_dead_agents(Clock::time_point now) {
  const auto limit = opts_.heartbeat_interval * 2;
  std::vector<std::string> dead;
  for (const auto& [name, agent] : agents_) {
    if (now - agent.last_seen > limit) dead.push_back(name);
  }
  for (const auto& name : dead) {
    auto silent = std::chrono::duration_cast<std::chrono::milliseconds>(
        now - agents_[name].last_seen);
    spdlog::warn("agent '{}' sent no heartbeat for {} ms", name, silent.count());
    drop_agent(name, "declared dead");
  }
  if (!dead.empty()) serve_waiting();
}

}  // namespace leasehold
