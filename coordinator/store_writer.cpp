#include "coordinator/store_writer.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <exception>
#include <stdexcept>
#include <utility>

namespace leasehold {
namespace {

using Clock = std::chrono::steady_clock;
constexpr std::chrono::milliseconds kFirstBackoff{50};
constexpr std::chrono::milliseconds kMaxBackoff{2000};

}  // namespace

StoreWriter::StoreWriter(std::unique_ptr<JobStore> store, std::function<void()> notify,
                         std::chrono::milliseconds drain_timeout)
    : store_(std::move(store)), notify_(std::move(notify)), drain_timeout_(drain_timeout) {
  if (!store_) throw std::invalid_argument("StoreWriter needs a job store");
  thread_ = std::thread([this] { run(); });
}

StoreWriter::~StoreWriter() {
  try {
    {
      std::lock_guard lock(mu_);
      stopping_ = true;
      drain_deadline_ = Clock::now() + drain_timeout_;
    }
    wake_.notify_all();
    if (thread_.joinable()) thread_.join();
  } catch (const std::exception& e) {
    spdlog::error("store writer for {}: could not stop cleanly: {}", store_->path(), e.what());
  }
}

uint64_t StoreWriter::write(std::vector<StoredJob> puts, std::vector<uint64_t> deletes,
                            uint64_t next_id) {
  uint64_t seq;
  {
    std::lock_guard lock(mu_);
    for (StoredJob& job : puts) {
      uint64_t id = job.id;
      pending_.ops[id] = std::move(job);
    }
    for (uint64_t id : deletes) pending_.ops[id] = std::nullopt;
    pending_.next_id = std::max(pending_.next_id, next_id);
    seq = pending_.seq = ++last_seq_;
  }
  wake_.notify_one();
  return seq;
}

uint64_t StoreWriter::committed() const { return committed_.load(std::memory_order_acquire); }

std::string StoreWriter::error() const {
  std::lock_guard lock(mu_);
  return error_;
}

CommitResult StoreWriter::commit(const Batch& batch) {
  try {
    std::vector<StoredJob> puts;
    std::vector<uint64_t> deletes;
    for (const auto& [id, job] : batch.ops) {
      if (job)
        puts.push_back(*job);
      else
        deletes.push_back(id);
    }
    return store_->commit(puts, deletes, batch.next_id);
  } catch (const std::exception& e) {  // bad_alloc: retried like any failure
    return {false, "job store " + store_->path() + ": commit failed: " + e.what()};
  }
}

void StoreWriter::run() {
  auto backoff = kFirstBackoff;
  std::string logged_error;  // warn once per distinct message
  uint64_t failures = 0;
  std::unique_lock lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || pending_.seq != 0; });
    if (pending_.seq == 0) break;  // stopping with nothing left

    Batch batch = std::exchange(pending_, Batch{});
    lock.unlock();
    CommitResult result = commit(batch);
    lock.lock();

    if (result.ok) {
      committed_.store(batch.seq, std::memory_order_release);
      error_.clear();
      if (failures > 0)
        spdlog::info("job store {}: commits succeed again after {} failed attempts", store_->path(),
                     failures);
      failures = 0;
      logged_error.clear();
      backoff = kFirstBackoff;
    } else {
      // Put the batch back under what arrived meanwhile: newer writes win.
      for (auto& [id, job] : batch.ops) pending_.ops.try_emplace(id, std::move(job));
      pending_.next_id = std::max(pending_.next_id, batch.next_id);
      pending_.seq = std::max(pending_.seq, batch.seq);
      error_ = result.error;
      ++failures;
      if (result.error != logged_error) {
        spdlog::warn("{} (retrying, {} writes waiting)", result.error,
                     pending_.seq - committed_.load(std::memory_order_relaxed));
        logged_error = result.error;
      }
    }

    lock.unlock();
    try {
      if (notify_) notify_();
    } catch (const std::exception& e) {
      spdlog::error("job store {}: notify callback threw: {}", store_->path(), e.what());
    }
    lock.lock();

    if (!result.ok) {
      // Back off, but wake at once when asked to stop (to start draining),
      // and never start an attempt after the drain deadline.
      bool was_stopping = stopping_;
      auto until = Clock::now() + backoff;
      if (stopping_) until = std::min(until, drain_deadline_);
      wake_.wait_until(lock, until, [&] { return stopping_ != was_stopping; });
      if (stopping_ && Clock::now() >= drain_deadline_) break;
      backoff = std::min(backoff * 2, kMaxBackoff);
    }
  }
  if (pending_.seq != 0) {
    uint64_t done = committed_.load(std::memory_order_relaxed);
    spdlog::error(
        "store writer stopping with {} writes (sequence {} to {}, {} jobs) not committed: {}",
        pending_.seq - done, done + 1, pending_.seq, pending_.ops.size(), error_);
  }
}

}  // namespace leasehold
