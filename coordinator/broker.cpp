#include "coordinator/broker.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/eventfd.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>
#include <thread>

#include "coordinator/broker_setup.h"
#include "coordinator/chunk_renewer.h"
#include "coordinator/file_workers.h"
#include "coordinator/http_endpoint.h"
#include "coordinator/job_codec.h"
#include "coordinator/job_store.h"
#include "coordinator/mps_daemon.h"
#include "coordinator/occupancy_policy.h"
#include "coordinator/socket_files.h"
#include "coordinator/store_writer.h"
#include "coordinator/wire.h"
#include "coordinator/zap_handler.h"
#include "shared/connection.h"
#include "shared/curve_keys.h"
#include "shared/endpoint.h"
#include "shared/process.h"
#include "shared/units.h"

namespace leasehold {
namespace {

// Workers for file checks: a few, so one hung path does not stop the others.
constexpr size_t kFileWorkers = 4;
// How often the loop checks that the MPS control daemon answers.
constexpr auto kMpsCheckInterval = std::chrono::seconds(10);
// How often the HTTP endpoint's copy of the status is refreshed.
constexpr auto kHttpPublishInterval = std::chrono::milliseconds(250);

}  // namespace

Broker::Broker(const CoordinatorOptions& opts)
    : opts_(opts),
      ctx_(1),
      router_(ctx_, zmq::socket_type::router),
      pub_(ctx_, zmq::socket_type::pub),
      malformed_(opts.malformed_limit) {
  const SocketAccess socket_files = socket_access(opts_.socket_mode, opts_.socket_group);
  prepare_socket_directory(opts_.endpoint, socket_files);
  ensure_no_live_coordinator(ctx_, opts_.endpoint);
  lock_fd_.reset(lock_state_dir(opts_.state_dir, socket_files.group));

  // The store first: a corrupt one stops us before any GPU memory is taken.
  auto store = JobStore::open(opts_.state_dir + "/jobs.db");
  JobStore::Contents stored = store->load();
  std::vector<JobRecord> jobs;
  for (const auto& row : stored.jobs) {
    try {
      jobs.push_back(decode_job(row.id, row.record));
    } catch (const std::exception& e) {
      throw std::runtime_error("job store " + store->path() + ": " + e.what() +
                               "; move the file away to start with an empty store");
    }
  }

  // The agents run under MPS; the coordinator, whose context holds the
  // pool, stays outside it so a fault in an agent cannot take the pool
  // along (coordinator/mps_daemon.h).
  mps_ = start_mps(opts_);
  // Not even through an inherited CUDA_MPS_PIPE_DIRECTORY.
  if (mps_) ::unsetenv("CUDA_MPS_PIPE_DIRECTORY");
  Backend backend = resolve_backend(opts_.backend);
  if (backend != Backend::Cuda && mps_) {
    if (opts_.mps == "on")
      throw std::runtime_error("mps = on needs the cuda backend, but no GPU is visible");
    mps_.reset();
  }
  create_pools(backend);

  wake_fd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake_fd_.get() < 0) throw std::runtime_error(std::string("eventfd: ") + std::strerror(errno));
  auto wake = [fd = wake_fd_.get()] {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(fd, &one, sizeof one);
  };
  store_ = std::make_unique<StoreWriter>(std::move(store), wake);
  files_ = std::make_unique<FileWorkers>(kFileWorkers, wake);
  renewer_ = std::make_unique<ChunkRenewer>(
      [this](int device) -> DevicePool* {
        for (const auto& pool : device_pools_) {
          if (pool->descriptor().device == device) return pool.get();
        }
        return nullptr;
      },
      wake);
  CoreOptions core_opts = core_options(opts_);
  if (mps_) core_opts.mps_pipe_directory = mps_->pipe_directory();
  core_opts.chunk_socket = chunk_socket_path(opts_.endpoint, opts_.state_dir);
  std::vector<PoolDescriptor> pools;
  for (const auto& pool : device_pools_) pools.push_back(pool->descriptor());
  core_ = std::make_unique<CoordinatorCore>(std::move(core_opts), std::move(pools),
                                            make_policy(opts_), now());
  uint64_t next_id = std::max(stored.next_id, largest_checkpoint_id(opts_.state_dir) + 1);
  if (next_id != stored.next_id) {
    spdlog::warn(
        "job ids start at {}: checkpoint folders of jobs the store does not know are in "
        "{}/checkpoints",
        next_id, opts_.state_dir);
  }
  Effects effects;
  core_->recover(std::move(jobs), next_id, now(), effects);
  apply(effects);

  // The ZAP handler, bound before the sockets it serves, looks up ipc://
  // peers' users and groups off the loop and decides which CURVE keys get
  // in on network endpoints. Each socket is a CURVE server exactly when its
  // own endpoint crosses the network.
  const bool curve = needs_curve(opts_.endpoint) || needs_curve(opts_.events_endpoint);
  zap_ = std::make_unique<ZapHandler>(
      ctx_, curve ? std::optional<std::string>(opts_.curve_allowed_keys) : std::nullopt);
  router_.set(zmq::sockopt::zap_domain, ZapHandler::kDomain);
  if (curve) {
    CurveKeyPair keys;
    try {
      keys = read_curve_key_pair(opts_.curve_key);
    } catch (const std::exception& e) {
      throw std::runtime_error(std::string("curve_key: ") + e.what());
    }
    for (auto [socket, endpoint] :
         {std::pair{&router_, &opts_.endpoint}, std::pair{&pub_, &opts_.events_endpoint}}) {
      if (!needs_curve(*endpoint)) continue;
      socket->set(zmq::sockopt::curve_server, true);
      socket->set(zmq::sockopt::curve_secretkey, keys.secret_key);
    }
    spdlog::info(
        "CURVE on network endpoints: public key {}, {} client and {} agent keys "
        "allowed from {}",
        keys.public_key, zap_->allowed_keys(false), zap_->allowed_keys(true),
        opts_.curve_allowed_keys);
  }
  router_.set(zmq::sockopt::linger, 0);
  router_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxMessageBytes));
  // The chunk socket before the endpoint: a registered agent asks it at once.
  chunks_ = std::make_unique<ChunkServer>(
      chunk_socket_path(opts_.endpoint, opts_.state_dir),
      [&](const std::string& path) { secure_socket_file(path, socket_files); },
      [this](const ChunkRequest& req, pid_t pid, uid_t) { return decide_chunks(req, pid); });
  bind_socket(router_, opts_.endpoint, socket_files, "");
  pub_.set(zmq::sockopt::linger, 0);
  prepare_socket_directory(opts_.events_endpoint, socket_files);
  bind_socket(pub_, opts_.events_endpoint, socket_files, "the events endpoint ");
  if (opts_.http_listen != "off") {
    http_ = std::make_unique<HttpEndpoint>(opts_.http_listen);
    for (const auto& [id, job] : core_->jobs().all()) http_jobs_changed_.insert(id);
    publish_http();
  }
  // The alignment in force: the configured one, or the mapping granularity
  // it was raised to.
  spdlog::info("{} device{} ({}), alignment {}; jobs in {}; listening on {}{}",
               device_pools_.size(), device_pools_.size() > 1 ? "s" : "", backend_name(backend),
               format_bytes(device_pools_.empty() ? opts_.alignment
                                                  : device_pools_.front()->descriptor().alignment),
               opts_.state_dir,
               opts_.endpoint,
               http_ ? "; HTTP on " + http_address() : std::string());
}

Broker::~Broker() {
  http_.reset();  // no more requests served from state about to go
  // The writer commits what is queued before it stops; then nothing more
  // can be sent (the loop has ended), so held messages are dropped.
  // The workers go before the eventfd they wake (a member declared earlier).
  store_.reset();
  files_.reset();
  renewer_.reset();
  // ZeroMQ's ipc listener unlinks its socket file when the socket closes.
}

ChunkServer::Decision Broker::decide_chunks(const ChunkRequest& req, pid_t peer_pid) const {
  ChunkServer::Decision d;
  auto answer = core_->chunks_for(req, peer_pid);
  if (auto* why = std::get_if<std::string>(&answer)) {
    d.refusal = *why;
    return d;
  }
  const ChunkGrant& grant = std::get<ChunkGrant>(answer);
  for (const auto& pool : device_pools_) {
    if (pool->descriptor().device == grant.device) d.pool = pool.get();
  }
  if (d.pool) d.grant = grant;
  else d.refusal = "device " + std::to_string(grant.device) + " has no pool";
  return d;
}

std::string Broker::summary() const {
  std::string s = core_->summary();
  if (!store_error_.empty()) s += "; JOB STORE FAILING: " + store_error_;
  return s;
}

Now Broker::now() const {
  const uint64_t us = unix_time_us();
  return Now{Clock::now(), us / 1000, us};
}

void Broker::run(const std::atomic<bool>& stop, const std::function<void()>& tick_fn) {
  // Wake often enough to purge dead agents well within three intervals.
  const auto tick = std::max(std::chrono::milliseconds(5), opts_.heartbeat_interval / 4);
  Clock::time_point last_tick = Clock::now();
  while (!stop.load()) {
    auto timeout = tick;
    if (auto d = core_->next_deadline()) {
      auto until = std::chrono::duration_cast<std::chrono::milliseconds>(*d - Clock::now());
      timeout =
          std::clamp(until + std::chrono::milliseconds(1), std::chrono::milliseconds(0), tick);
    }
    std::vector<zmq::pollitem_t> items = {{router_.handle(), 0, ZMQ_POLLIN, 0},
                                          {nullptr, wake_fd_.get(), ZMQ_POLLIN, 0},
                                          {nullptr, chunks_->listen_fd(),
                                           static_cast<short>(chunks_->accepting() ? ZMQ_POLLIN : 0), 0}};
    for (int fd : chunks_->connections()) items.push_back({nullptr, fd, ZMQ_POLLIN, 0});
    try {
      zmq::poll(items.data(), items.size(), timeout);
    } catch (const zmq::error_t& e) {
      if (e.num() != EINTR) throw;
    }
    if (items[1].revents & ZMQ_POLLIN) wake_fd_drain();
    if (items[0].revents & ZMQ_POLLIN) receive_requests();
    // After the requests: a grant the agent just received is in the core.
    for (size_t i = 3; i < items.size(); ++i) {
      if (items[i].revents & (ZMQ_POLLIN | ZMQ_POLLERR)) chunks_->serve(items[i].fd);
    }
    if (items[2].revents & ZMQ_POLLIN) chunks_->accept_pending();

    Effects effects;
    for (auto& r : files_->take_results()) {
      core_->file_check_done(r.token, r.problems, now(), effects);
    }
    for (auto& r : files_->take_reads()) core_->checkpoint_read_done(r, effects);
    for (auto& d : renewer_->take_done()) {
      core_->chunks_renewed(d.device, d.lease_id, d.error, effects);
    }
    std::string error = store_->error();
    if (error != store_error_) {
      if (error.empty()) {
        spdlog::info("job store commits again");
      } else {
        spdlog::error("job store cannot commit: {}", error);
      }
      store_error_ = error;
      core_->set_store_error(error);
      if (!error.empty()) withdraw_unstored(effects);
    }
    // The loop runs at least every `tick`: a longer gap is time nobody
    // could be heard in (a SIGSTOP, a VM pause, CPU starvation, a stalled
    // disk), not agents' silence.
    const Now at = now();
    if (at.steady - last_tick > 2 * tick) core_->stalled(at.steady - last_tick - tick, at);
    last_tick = at.steady;
    core_->tick(at, effects);
    apply(effects);
    release_committed();
    check_mps();
    // What the HTTP endpoint serves, a few times a second: its threads read
    // this copy and never reach into the core.
    if (http_ && Clock::now() - http_published_ >= kHttpPublishInterval) publish_http();
    log_malformed(false);
    if (tick_fn) tick_fn();
  }
  // Acknowledgements waiting for their commit still go out if the store
  // catches up within a moment.
  for (int i = 0; i < 100 && !held_.empty() && store_error_.empty(); ++i) {
    release_committed();
    if (!held_.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  spdlog::info("stopping: telling {} agents", core_->agents().size());
  Effects bye;
  core_->shutdown(bye);
  for (auto& m : bye.messages) {
    Outgoing o{false, m.to, encode_message(m)};
    send(o);
  }
  // The Shutdowns are only queued: a moment for them to leave before the
  // socket closes (linger was 0 so that a dead peer never holds up a stop).
  // An agent that misses its Shutdown takes the coordinator for paused
  // and waits, instead of registering with the next one at once.
  router_.set(zmq::sockopt::linger, 500);
}

void Broker::check_mps() {
  if (!mps_) return;
  const auto t = Clock::now();
  const bool fault = core_->device_faults() != mps_faults_seen_;
  if (!fault && t - mps_checked_ < kMpsCheckInterval) return;
  mps_checked_ = t;
  mps_faults_seen_ = core_->device_faults();
  if (mps_->alive()) {
    if (mps_down_reported_) spdlog::info("MPS control daemon answers again");
    mps_down_reported_ = false;
    return;
  }
  if (mps_->restart()) {
    mps_down_reported_ = false;
    return;
  }
  if (!mps_down_reported_) {
    spdlog::error(
        "the MPS control daemon of {} does not answer: agents cannot start GPU work "
        "until it is back (restart its unit)",
        mps_->pipe_directory());
    mps_down_reported_ = true;
  }
}

void Broker::wake_fd_drain() {
  uint64_t n;
  while (::read(wake_fd_.get(), &n, sizeof n) > 0) {
  }
}

void Broker::receive_requests() {
  // Drain what arrived (bounded, so housekeeping still runs under load).
  for (int i = 0; i < 1024; ++i) {
    std::vector<zmq::message_t> frames;
    size_t frame_count = 0;
    zmq::message_t frame;
    try {
      bool got = router_.recv(frame, zmq::recv_flags::dontwait).has_value();
      while (got) {
        bool more = frame.more();
        // Frames past the third are counted, not kept: a message of a
        // million frames costs no memory.
        if (++frame_count <= 3) frames.push_back(std::move(frame));
        if (!more) break;
        got = router_.recv(frame, zmq::recv_flags::none).has_value();
      }
    } catch (const zmq::error_t& e) {
      if (e.num() == EINTR) continue;
      throw;
    }
    if (frames.empty()) return;
    std::string rid = frames[0].to_string();
    if (malformed_.drop(rid)) continue;
    if (frame_count != 2) {
      reject_malformed(
          rid, 0, ErrorCode::Malformed,
          "expected a single-frame message, got " + std::to_string(frame_count - 1) + " frames");
      continue;
    }
    handle(rid, frames[1], peer_of(frames[1]));
  }
}

void Broker::handle(const std::string& routing_id, zmq::message_t& payload, const Peer& peer) {
  AlignedBytes bytes(payload);
  auto decoded = decode(bytes.bytes());
  if (auto* err = std::get_if<DecodeError>(&decoded)) {
    // Echo the request id when the header can be trusted enough to read it.
    uint64_t request_id = 0;
    if (err->code == ErrorCode::BadVersion) {
      request_id = proto::GetEnvelope(bytes.bytes().data())->header()->request_id();
    }
    return reject_malformed(
        routing_id, request_id, err->code,
        "message of " + std::to_string(payload.size()) + " bytes: " + err->message);
  }
  Effects effects;
  core_->handle(routing_id, *std::get<const proto::Envelope*>(decoded), now(), effects, peer);
  apply(effects);
}

void Broker::apply(Effects& effects) {
  const bool writes = effects.writes_store();
  // What acknowledges stored state waits for the commit; the rest goes now.
  std::vector<Outgoing> later;
  for (const auto& m : effects.messages) {
    Outgoing o{false,       m.to, encode_message(m), m.job, m.body.type == proto::Body::JobAccepted,
               m.request_id};
    if (writes && m.after_store) {
      later.push_back(std::move(o));
    } else {
      send(o);
    }
  }
  std::sort(effects.events.begin(), effects.events.end());
  effects.events.erase(std::unique(effects.events.begin(), effects.events.end()),
                       effects.events.end());
  for (uint64_t id : effects.events) {
    if (const JobRecord* job = core_->jobs().find(id)) {
      Outgoing o{true, event_topic(id), encode_event(*job), id};
      if (writes) {
        later.push_back(std::move(o));
      } else {
        send(o);
      }
    }
  }
  for (const auto& n : effects.notices) {
    Outgoing o{true, n.topic, encode_notice(n)};
    send(o);
  }
  if (http_) note_for_http(effects);
  for (const auto& dir : effects.remove_dirs) files_->remove_dir(dir);
  for (auto& check : effects.file_checks) files_->check(std::move(check));
  for (auto& read : effects.checkpoint_reads) files_->read(std::move(read));
  for (const auto& r : core_->take_chunk_renewals()) renewer_->renew(r);
  if (!writes) return;

  std::vector<StoredJob> puts;
  for (uint64_t id : effects.store_puts) {
    const JobRecord* job = core_->jobs().find(id);
    if (!job) continue;  // pruned in the same call
    puts.push_back(StoredJob{id, job_state_name(job->state), job->finished_ms, encode_job(*job)});
  }
  uint64_t seq = store_->write(std::move(puts), effects.store_deletes, core_->jobs().next_id());
  if (!later.empty()) held_.push_back(Held{seq, std::move(later)});
}

void Broker::reject_malformed(const std::string& routing_id, uint64_t request_id, ErrorCode code,
                              const std::string& why) {
  Outgoing o{false, routing_id,
             make_error({request_id, "coordinator", {}}, code, malformed_.reject(routing_id, why))};
  send(o);
  log_malformed(false);
}

void Broker::log_malformed(bool force) {
  // Once per interval, not once per message: a flood cannot fill the log.
  if (auto line = malformed_.take_log_line(Clock::now(), force); !line.empty()) {
    spdlog::warn("{}", line);
  }
}

void Broker::withdraw_unstored(Effects& effects) {
  release_committed();  // what is committed goes out first
  std::set<uint64_t> accepted, withdrawn;
  for (const auto& h : held_) {
    for (const auto& o : h.messages) {
      if (o.accepts) accepted.insert(o.job);
    }
  }
  for (uint64_t id : accepted) {
    if (core_->withdraw_submission(id, now(), effects)) withdrawn.insert(id);
  }
  if (withdrawn.empty()) return;
  for (auto& h : held_) {
    std::vector<Outgoing> kept;
    for (auto& o : h.messages) {
      if (!withdrawn.count(o.job)) {
        kept.push_back(std::move(o));
      } else if (o.accepts) {
        Outgoing refusal{false, o.address,
                         make_error({o.request_id, "coordinator", {}}, ErrorCode::Unavailable,
                                    "job " + std::to_string(o.job) +
                                        " was not queued: the job store could not commit it (" +
                                        store_error_ + "); try again once it can")};
        send(refusal);
      }
    }
    h.messages = std::move(kept);
  }
}

void Broker::release_committed() {
  uint64_t committed = store_->committed();
  while (!held_.empty() && held_.front().seq <= committed) {
    for (auto& o : held_.front().messages) send(o);
    held_.pop_front();
  }
}

void Broker::send(Outgoing& o) {
  zmq::socket_t& socket = o.event ? pub_ : router_;
  try {
    socket.send(zmq::buffer(o.address), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    socket.send(o.body, zmq::send_flags::dontwait);
  } catch (const zmq::error_t& e) {
    spdlog::warn("could not send {}: {}", o.event ? "an event" : "a reply", e.what());
  }
}

}  // namespace leasehold
