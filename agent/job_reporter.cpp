#include "agent/job_reporter.h"

#include <spdlog/spdlog.h>

namespace leasehold {
namespace {

bool is_final(const proto::JobUpdateT& u) { return u.state != "running"; }

}  // namespace

JobReporter::JobReporter(AgentSession& session)
    : session_(session), thread_([this] { loop(); }) {}

JobReporter::~JobReporter() { stop(std::chrono::seconds(3)); }

void JobReporter::stop(std::chrono::milliseconds drain) {
  std::lock_guard serial(stop_mu_);
  if (!thread_.joinable()) return;
  if (!flush(drain)) {
    std::lock_guard lock(mu_);
    for (const auto& u : reliable_) {
      spdlog::error("could not deliver the {} report of job {} attempt {} before stopping",
                    u.state, u.job_id, u.attempt);
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
    bool done = true, retry = false;
    try {
      session_.send_job_update(update);
      if (is_final(update)) session_.heartbeat_soon();  // the agent's jobs changed
    } catch (const Error& e) {
      if (e.code() == ErrorCode::Timeout || e.code() == ErrorCode::UnknownSender) {
        // Not delivered: the coordinator is away or restarting.
        done = !is_reliable;
        retry = true;
        spdlog::debug("report of job {} not delivered yet: {}", update.job_id, e.what());
      } else {
        spdlog::warn("coordinator refused the {} report of job {} attempt {}: {}", update.state,
                     update.job_id, update.attempt, e.what());
      }
    } catch (const std::exception& e) {
      spdlog::warn("could not report job {}: {}", update.job_id, e.what());
    }
    if (retry) session_.wait_connected(std::chrono::milliseconds(500));
    lock.lock();
    if (done && is_reliable) reliable_.pop_front();
    sending_ = false;
    cv_.notify_all();
    if (retry && !done) {
      // Back off a little before the same report goes again.
      cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_; });
      if (stop_) return;
    }
  }
}

}  // namespace leasehold
