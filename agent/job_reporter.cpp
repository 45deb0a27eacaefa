#include "agent/job_reporter.h"

#include <spdlog/spdlog.h>

#include "shared/protocol.h"

namespace leasehold {
namespace {

bool is_final(const proto::JobUpdateT& u) { return u.status != proto::JobStatus::Running; }

// Refusals that sending again cannot change: the job or attempt is not this
// agent's any more, or the report itself is wrong.
bool permanent(ErrorCode code) {
  return code == ErrorCode::NotOwner || code == ErrorCode::InvalidArgument ||
         code == ErrorCode::Malformed || code == ErrorCode::BadVersion;
}

}  // namespace

JobReporter::JobReporter(JobChannel& jobs) : jobs_(jobs), thread_([this] { loop(); }) {}

JobReporter::~JobReporter() { stop(std::chrono::seconds(3)); }

void JobReporter::stop(std::chrono::milliseconds drain) {
  std::lock_guard serial(stop_mu_);
  if (!thread_.joinable()) return;
  if (!flush(drain)) {
    std::lock_guard lock(mu_);
    for (const auto& u : reliable_) {
      spdlog::error("could not deliver the {} report of job {} attempt {} before stopping",
                    job_status_name(u.status), u.job_id, u.attempt);
    }
  }
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void JobReporter::progress(proto::JobUpdateT update) {
  std::lock_guard lock(mu_);
  if (stop_) return;
  progress_[update.job_id] = std::move(update);
  cv_.notify_all();
}

void JobReporter::reliable(proto::JobUpdateT update) {
  std::lock_guard lock(mu_);
  if (stop_) return;
  if (is_final(update)) progress_.erase(update.job_id);  // stale now
  // A program that writes faster than the coordinator takes (or while it is
  // away) costs a bounded queue: its oldest waiting output goes first (not
  // the one being sent, which stays at the front until acknowledged).
  size_t dropped = 0;
  for (auto it = reliable_.begin() + (sending_ && !reliable_.empty() ? 1 : 0);
       it != reliable_.end() && queued_output_ + update.log.size() > kMaxQueuedOutput;) {
    if (!it->log.empty() && !is_final(*it) && !it->epoch) {
      queued_output_ -= it->log.size();
      dropped += it->log.size();
      it = reliable_.erase(it);
    } else {
      ++it;
    }
  }
  if (dropped) {
    spdlog::warn("job {}: {} bytes of its output dropped: the coordinator does not take it as "
                 "fast as it comes",
                 update.job_id, dropped);
  }
  queued_output_ += update.log.size();
  reliable_.push_back(std::move(update));
  cv_.notify_all();
}

std::vector<std::pair<uint64_t, uint32_t>> JobReporter::pending_finals() const {
  std::lock_guard lock(mu_);
  std::vector<std::pair<uint64_t, uint32_t>> out;
  for (const auto& u : reliable_) {
    if (is_final(u)) out.emplace_back(u.job_id, u.attempt);
  }
  return out;
}

bool JobReporter::flush(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return reliable_.empty() && !sending_; });
}

void JobReporter::loop() {
  std::unique_lock lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return stop_ || !reliable_.empty() || !progress_.empty(); });
    if (stop_) return;
    bool is_reliable = !reliable_.empty();
    proto::JobUpdateT update;
    if (is_reliable) {
      update = reliable_.front();
    } else {
      update = std::move(progress_.begin()->second);
      progress_.erase(progress_.begin());
    }
    sending_ = true;
    lock.unlock();
    bool delivered = false;
    try {
      jobs_.send_update(update);
      delivered = true;
      if (is_final(update)) jobs_.jobs_changed();
    } catch (const Error& e) {
      if (permanent(e.code())) {
        spdlog::warn("coordinator refused the {} report of job {} attempt {}: {}",
                     job_status_name(update.status), update.job_id, update.attempt, e.what());
        delivered = true;  // dropped: it can never be taken
      } else {
        // Away, restarting, or failing inside: the report goes again.
        spdlog::debug("report of job {} not delivered yet: {}", update.job_id, e.what());
      }
    } catch (const std::exception& e) {
      spdlog::warn("could not report job {}: {}", update.job_id, e.what());
    }
    if (!delivered) jobs_.session().wait_connected(std::chrono::milliseconds(500));
    lock.lock();
    if (is_reliable && delivered) {
      queued_output_ -= reliable_.front().log.size();
      reliable_.pop_front();
    }
    sending_ = false;
    cv_.notify_all();
    if (delivered) {
      backoff_ = std::chrono::milliseconds(0);
    } else {
      // Progress is best-effort: a newer one replaces it. A reliable report
      // waits a little longer each time before it goes again.
      backoff_ = std::min(std::chrono::milliseconds(1000),
                          std::max(std::chrono::milliseconds(50), backoff_ * 2));
      cv_.wait_for(lock, backoff_, [&] { return stop_; });
      if (stop_) return;
    }
  }
}

}  // namespace leasehold
