#include "agent/job_worker.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>

#include "agent/engine/allocator.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine_job.h"
#include "agent/job_runner.h"
#include "agent/lease_allocator.h"
#include "shared/job_spec.h"
#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold {
namespace {

// Finished jobs remembered to ignore late pushes for them.
constexpr size_t kRemembered = 256;
// How often an idle worker checks that its GPU context still works.
constexpr auto kIdleDeviceCheck = std::chrono::seconds(1);

}  // namespace

JobWorker::JobWorker(AgentSession& session, std::function<void(const std::string&)> announce,
                     spill::AgentSpill* spill, JobWorkerOptions options)
    : session_(session),
      spill_(spill),
      engine_(std::make_unique<EngineJob>(session, spill,
                                          EngineJobOptions{options.dataset_regions})),
      program_(std::make_unique<ProgramJob>(session, options.programs)),
      jobs_(session),
      reporter_(jobs_),
      options_(options) {
  session_.set_shrink_handler([this](const proto::ShrinkT& s) { on_shrink(s); });
  jobs_.set_handlers(
      [this](JobAssignment job) { on_assign(std::move(job)); },
      [this](uint64_t id, uint32_t attempt, bool cancel, const std::string& reason) {
        on_stop(id, attempt, cancel, reason);
      },
      [this] { return job_states(); });
  session_.set_session_listener([this, announce = std::move(announce)](const std::string& why) {
    session_changed(why);
    if (announce) announce(why);
  });
}

JobWorker::~JobWorker() {
  session_.set_shrink_handler({});
  session_.set_session_listener({});
  jobs_.set_handlers({}, {}, {});
  reporter_.stop(std::chrono::seconds(3));
}

void JobWorker::remember(const Key& key) {
  finished_.push_back(key);
  if (finished_.size() > kRemembered) finished_.pop_front();
}

bool JobWorker::known(const Key& key) const {
  if (current_ == key) return true;
  if (std::any_of(queue_.begin(), queue_.end(), [&](const Assigned& a) { return a.key == key; })) {
    return true;
  }
  return std::find(finished_.begin(), finished_.end(), key) != finished_.end();
}

proto::JobUpdateT JobWorker::final_update(const Key& key, const std::string& state,
                                          const std::string& reason) const {
  proto::JobUpdateT u;
  u.job_id = key.first;
  u.attempt = key.second;
  // (The worker's words for an outcome are the statuses' names.)
  u.status = parse_job_status(state).value_or(proto::JobStatus::Unset);
  u.reason = reason;
  return u;
}

std::string JobWorker::session_lost_reason() const {
  return "the agent lost its coordinator session (" +
         (session_loss_.empty() ? std::string("it restarted") : session_loss_) + ") at epoch " +
         std::to_string(epoch_.load());
}

void JobWorker::on_assign(JobAssignment job) {
  std::lock_guard lock(mu_);
  Key key{job.job_id, job.attempt};
  if (known(key)) return;  // the same push again, or via another socket
  if (device_lost_) {
    // run() has returned; the agent is about to start itself again.
    remember(key);
    reporter_.reliable(final_update(key, "interrupted",
                                    "agent '" + session_.name() +
                                        "' lost its GPU context and restarts (" + *device_lost_ +
                                        "); the job did not start"));
    return;
  }
  queue_.push_back(Assigned{key, std::move(job.spec), job.checkpoint_owner,
                            std::move(job.job_token), job.replica,
                            std::chrono::steady_clock::now()});
  cv_.notify_all();
}

void JobWorker::on_stop(uint64_t id, uint32_t attempt, bool cancel, const std::string& reason) {
  std::lock_guard lock(mu_);
  Key key{id, attempt};
  if (current_ == key) {
    if (stop_cause_ == StopCause::None) {
      stop_cause_ = cancel ? StopCause::Cancel : StopCause::Coordinator;
      stop_reason_ = reason;
    }
    stop_requested_.store(true);
    return;
  }
  auto queued = std::find_if(queue_.begin(), queue_.end(),
                             [&](const Assigned& a) { return a.key == key; });
  if (queued != queue_.end()) {
    queue_.erase(queued);
  } else if (std::find(finished_.begin(), finished_.end(), key) != finished_.end()) {
    return;  // it has ended; its report says how
  }
  // Not started, or its assignment never arrived: it ends here, and a late
  // assignment for it is ignored.
  remember(key);
  if (cancel) {
    reporter_.reliable(final_update(key, "cancelled", "cancelled before it started"));
  } else {
    reporter_.reliable(final_update(key, "interrupted", reason + " (before it started)"));
  }
  say("job %llu stopped before it started: %s\n", (unsigned long long)id, reason.c_str());
}

std::vector<proto::AgentJobT> JobWorker::job_states() {
  std::vector<proto::AgentJobT> out;
  std::lock_guard lock(mu_);
  if (current_) {
    proto::AgentJobT j;
    j.job_id = current_->first;
    j.attempt = current_->second;
    j.phase = stop_requested_.load() ? proto::JobPhase::Stopping : proto::JobPhase::Running;
    j.epoch = static_cast<int32_t>(epoch_.load());
    j.global_step = global_step_.load();
    out.push_back(j);
  }
  for (const auto& a : queue_) {
    proto::AgentJobT j;
    j.job_id = a.key.first;
    j.attempt = a.key.second;
    j.phase = proto::JobPhase::Queued;
    out.push_back(j);
  }
  for (const auto& [id, attempt] : reporter_.pending_finals()) {
    proto::AgentJobT j;
    j.job_id = id;
    j.attempt = attempt;
    j.phase = proto::JobPhase::Reporting;
    out.push_back(j);
  }
  return out;
}

void JobWorker::session_changed(const std::string& why) {
  std::lock_guard lock(mu_);
  if (why.empty()) {
    // Registered again: the heartbeat that follows tells the coordinator
    // what this agent still has.
    jobs_.jobs_changed();
    return;
  }
  session_loss_ = why;
  if (current_) {
    if (stop_cause_ == StopCause::None) stop_cause_ = StopCause::SessionLost;
    stop_requested_.store(true);
  }
  // Jobs not started yet were assigned under the lost session's leases.
  for (const auto& a : queue_) {
    remember(a.key);
    reporter_.reliable(final_update(a.key, "interrupted",
                                    "the agent lost its coordinator session (" + why +
                                        ") before the job started"));
  }
  queue_.clear();
}

void JobWorker::pause_while_silent(uint64_t id, const std::atomic<bool>& stop) {
  const auto since = std::chrono::steady_clock::now();
  spdlog::warn("job {}: the coordinator has not answered for too long; pausing at this step "
               "boundary, touching no leased memory until it answers",
               id);
  const bool heard = session_.wait_may_touch(
      [&] { return stop.load() || stop_requested_.load(); });
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - since)
                      .count();
  if (heard) {
    spdlog::info("job {}: the coordinator answers again; resuming after a {} ms pause", id, ms);
  } else {
    spdlog::warn("job {}: stopping after a {} ms pause (session lost or stop requested)", id, ms);
  }
}

void JobWorker::on_shrink(const proto::ShrinkT& shrink) {
  if (options_.ignore_shrinks) {
    spdlog::warn("ignoring shrink {} of {} (test fault switch)", shrink.id,
                 format_bytes(shrink.bytes));
    return;
  }
  spdlog::info("asked to shrink job {} by {} within {} ms: {}", shrink.job_id,
               format_bytes(shrink.bytes), shrink.deadline_ms, shrink.reason);
  std::lock_guard lock(mu_);
  shrink_ = shrink;
  cv_.notify_all();
}

void JobWorker::answer_shrink(LeaseAllocator* leases, spill::SpillManager* spill) {
  proto::ShrinkT s;
  {
    std::lock_guard lock(mu_);
    if (!shrink_) return;
    if (leases && !(current_ && current_->first == shrink_->job_id)) leases = nullptr;
    s = std::move(*shrink_);
    shrink_.reset();
  }
  uint64_t before = 0, after = 0;
  std::string reason;
  if (leases) {
    auto held = [&] {
      engine::AllocatorStats st = leases->stats();
      return st.in_use_bytes + st.cached_bytes;
    };
    before = held();
    try {
      // Cached blocks first; then cold tensors to the spill store (their
      // memory goes to the cache), and whole free leases back again.
      leases->empty_cache();
      uint64_t freed = before - std::min(before, held());
      if (freed < s.bytes && spill) {
        spill->shrink(s.bytes - freed);
        leases->empty_cache();
      }
    } catch (const std::exception& e) {
      reason = std::string("shrinking failed: ") + e.what();
    }
    after = held();
    if (before - std::min(before, after) < s.bytes && reason.empty()) {
      engine::AllocatorStats st = leases->stats();
      reason = "the rest is in use (" + format_bytes(st.in_use_bytes) +
               ": parameters, gradients, optimizer state and live tensors)";
    }
  } else {
    reason = "job " + std::to_string(s.job_id) + " is not running on this agent";
  }
  uint64_t released = before - std::min(before, after);
  try {
    session_.send_shrink_done(s.id, released, after, reason);
  } catch (const std::exception& e) {
    spdlog::warn("could not answer shrink {}: {}", s.id, e.what());
  }
  if (leases) {
    say("job %llu released %s of %s asked (holds %s)\n", (unsigned long long)s.job_id,
        format_bytes(released).c_str(), format_bytes(s.bytes).c_str(),
        format_bytes(after).c_str());
  }
}

std::optional<std::string> JobWorker::device_lost() const {
  std::lock_guard lock(mu_);
  return device_lost_;
}

void JobWorker::run(const std::atomic<bool>& stop) {
  const engine::Device device = pool_device(session_.pool());
  auto checked = std::chrono::steady_clock::now();
  while (!stop.load() && !device_lost()) {
    Assigned job;
    answer_shrink(nullptr, nullptr);  // one for no job of ours
    {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(100),
                   [&] { return !queue_.empty() || shrink_.has_value(); });
      if (queue_.empty()) {
        lock.unlock();
        program_->idle();  // its Python standbys
        // Idle: is the context still there (a fault beside us, under MPS)?
        if (device.is_cuda() && std::chrono::steady_clock::now() - checked >= kIdleDeviceCheck) {
          checked = std::chrono::steady_clock::now();
          if (auto lost = engine::device_context_lost(device)) {
            spdlog::critical("this agent's GPU context is lost while idle: {}", *lost);
            std::lock_guard relock(mu_);
            device_lost_ = *lost;
          }
        }
        continue;
      }
      job = std::move(queue_.front());
      queue_.pop_front();
      current_ = job.key;
      stop_cause_ = StopCause::None;
      resumed_from_epoch_ = 0;
      stop_requested_.store(false);
      epoch_.store(0);
      global_step_.store(0);
    }
    if (device.is_cuda()) {
      // A context lost since the last check would fail the job at once and
      // make the fault look like its own.
      if (auto lost = engine::device_context_lost(device)) {
        spdlog::critical("this agent's GPU context is lost: {}", *lost);
        std::lock_guard lock(mu_);
        device_lost_ = *lost;
        remember(job.key);
        current_.reset();
        reporter_.reliable(final_update(job.key, "interrupted",
                                        "agent '" + session_.name() +
                                            "' lost its GPU context before the job started (" +
                                            *lost + "); the agent restarts"));
        break;
      }
    }
    run_one(job, stop);
  }
}

void JobWorker::run_one(const Assigned& assigned, const std::atomic<bool>& stop) {
  const auto [id, attempt] = assigned.key;
  const auto picked_up = std::chrono::steady_clock::now();
  const uint64_t registrations = session_.registrations();
  std::string name = "?";
  std::string state, reason;
  bool device_fault = false, replica_lost = false;
  int exit_code = -1;
  JobResult result;
  try {
    const proto::JobSpec* job = verify_job(assigned.spec);
    name = job->name() ? job->name()->str() : "?";
    say("job %llu '%s' started (attempt %u)\n", (unsigned long long)id, name.c_str(), attempt);
    JobAttempt a;
    a.id = id;
    a.attempt = attempt;
    a.name = name;
    a.checkpoint_owner = assigned.checkpoint_owner;
    a.job_token = assigned.job_token;
    a.replica = assigned.replica;
    a.reporter = &reporter_;
    const bool fault_here = !options_.test_fault_job.empty() && name == options_.test_fault_job;
    a.shrink_pending = [this, id] {
      std::lock_guard lock(mu_);
      return shrink_.has_value() && shrink_->job_id == id;
    };
    a.at_step_boundary = [this, fault_here, steps = int64_t{0}](
                             LeaseAllocator* leases, spill::SpillManager* spill) mutable {
      answer_shrink(leases, spill);
      if (leases && fault_here && ++steps == options_.test_fault_step) {
        spdlog::warn("test fault switch: making the GPU fault now (step {})", steps);
        engine::inject_device_fault(leases->device());
      }
    };
    // A stop request (cancel, lost session) or the agent stopping. First,
    // at this step boundary, the self-fence: while the coordinator has been
    // silent too long to be sure it has not fenced this agent's leases, the
    // job touches none of them (it pauses here, and goes on once the
    // coordinator answers, or stops when the session is lost).
    a.should_stop = [&] {
      if (!session_.may_touch()) pause_while_silent(id, stop);
      if (stop.load() && !stop_requested_.load()) {
        std::lock_guard lock(mu_);
        if (stop_cause_ == StopCause::None) stop_cause_ = StopCause::AgentStopping;
        stop_requested_.store(true);
      }
      return stop_requested_.load();
    };
    a.stopping = [&] { return stop.load() || stop_requested_.load(); };
    a.update = [&] {
      proto::JobUpdateT u;
      u.job_id = id;
      u.attempt = attempt;
      u.status = proto::JobStatus::Running;
      std::lock_guard lock(mu_);
      u.resumed_from_epoch = resumed_from_epoch_;
      return u;
    };
    a.resumed = [&](int64_t epoch) {
      std::lock_guard lock(mu_);
      resumed_from_epoch_ = static_cast<int32_t>(epoch);
    };
    a.position = [&](int64_t epoch, int64_t global_step) {
      epoch_.store(epoch);
      global_step_.store(global_step);
    };
    // Where the time between the assignment's arrival and the job's start goes.
    auto ms = [](auto x, auto y) { return std::chrono::duration<double, std::milli>(y - x).count(); };
    spdlog::info("job {} attempt {}: picked up {:.2f} ms after its assignment arrived, set up in "
                 "{:.2f} ms",
                 id, attempt, ms(assigned.received, picked_up),
                 ms(picked_up, std::chrono::steady_clock::now()));
    JobKind& kind = job->program() ? *program_ : *engine_;
    JobEnd end = kind.run(*job, a);
    result = std::move(end.result);
    exit_code = end.exit_code;
    if (end.failure.empty()) {
      state = "succeeded";
    } else {
      state = "failed";
      reason = std::move(end.failure);
    }
  } catch (const ReplicaLost& e) {
    // Another replica of its gang is gone (the coordinator restarts the
    // gang; it may learn of the loss from that replica's agent first), or
    // this one's GPU faulted under the collective.
    state = "interrupted";
    std::optional<std::string> context_lost =
        engine::device_context_lost(pool_device(session_.pool()));
    std::lock_guard lock(mu_);
    if (context_lost) {
      device_fault = true;
      device_lost_ = *context_lost;
      reason = "device fault on agent '" + session_.name() + "': " + *context_lost +
               "; the agent restarts";
    } else {
      replica_lost = true;
      reason = e.what();
    }
  } catch (const JobCancelled&) {
    std::lock_guard lock(mu_);
    switch (stop_cause_) {
      case StopCause::SessionLost:
        state = "interrupted";
        reason = session_lost_reason();
        break;
      case StopCause::AgentStopping:
        state = "interrupted";
        reason = "agent '" + session_.name() + "' is stopping";
        break;
      case StopCause::Coordinator:
        state = "interrupted";
        reason = "stopped by the coordinator: " + stop_reason_;
        break;
      default:
        state = "cancelled";
        reason = "cancelled by request";
    }
  } catch (const std::exception& e) {
    // A lease refused because the session went away shows up as an
    // out-of-memory or a lost lease: say what really happened.
    bool lost = !session_.connected() || session_.registrations() != registrations;
    // A lost GPU context shows up as whatever CUDA call came next.
    std::optional<std::string> context_lost =
        engine::device_context_lost(pool_device(session_.pool()));
    std::lock_guard lock(mu_);
    if (context_lost) {
      state = "interrupted";
      device_fault = true;
      device_lost_ = *context_lost;
      reason = "device fault on agent '" + session_.name() + "': " + *context_lost +
               "; the agent restarts";
    } else if (lost || stop_cause_ == StopCause::SessionLost) {
      state = "interrupted";
      reason = session_lost_reason();
    } else if (stop.load()) {
      // A wait (for memory) given up because the agent stops.
      state = "interrupted";
      reason = "agent '" + session_.name() + "' is stopping";
    } else {
      state = "failed";
      reason = e.what();
    }
  }
  if (state != "succeeded") {
    say("job %llu '%s' %s: %s\n", (unsigned long long)id, name.c_str(), state.c_str(),
        reason.c_str());
  }
  proto::JobUpdateT final = final_update(assigned.key, state, reason);
  final.device_fault = device_fault;
  final.replica_lost = replica_lost;
  final.exit_code = exit_code;
  final.test_accuracy = result.test_accuracy;
  final.samples_per_second = result.samples_per_second;
  // The memory figures at the end: the peak of the final evaluation is
  // past the last progress report.
  if (result.memory.epoch > 0 || result.memory.global_step > 0) {
    final.progress = std::make_unique<proto::ProgressT>(to_progress(result.memory));
  }
  {
    std::lock_guard lock(mu_);
    final.resumed_from_epoch = resumed_from_epoch_;
    reporter_.reliable(std::move(final));
    remember(assigned.key);
    current_.reset();
    stop_requested_.store(false);
  }
  jobs_.jobs_changed();
}

}  // namespace leasehold
