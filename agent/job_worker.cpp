#include "agent/job_worker.h"

#include <spdlog/spdlog.h>

#include <cstdio>

#include "agent/engine/allocator.h"
#include "agent/job_runner.h"
#include "agent/job_spec.h"
#include "agent/lease_allocator.h"
#include "shared/units.h"

namespace leasehold {
namespace {

proto::ProgressT to_progress(const JobProgress& p) {
  proto::ProgressT t;
  t.epoch = static_cast<int32_t>(p.epoch);
  t.epochs = static_cast<int32_t>(p.epochs);
  t.step = p.step;
  t.steps_in_epoch = p.steps_in_epoch;
  t.global_step = p.global_step;
  t.total_steps = p.total_steps;
  t.loss = p.loss;
  t.samples_per_second = p.samples_per_second;
  t.eta_seconds = p.eta_seconds;
  return t;
}

}  // namespace

JobWorker::JobWorker(AgentSession& session) : session_(session) {
  session_.set_job_handlers(
      [this](uint64_t id, std::vector<uint8_t> spec) {
        std::lock_guard lock(mu_);
        if (id <= last_assigned_) return;  // the same push via another socket
        last_assigned_ = id;
        queue_.emplace_back(id, std::move(spec));
        cv_.notify_all();
      },
      [this](uint64_t id) {
        if (current_.load() == id) cancel_.store(true);
      });
}

void JobWorker::session_changed(const std::string& why) {
  if (!why.empty()) {
    if (current_.load() != 0) cancel_.store(true);
    return;
  }
  // Registered again, possibly with a restarted coordinator whose job ids
  // start from 1 again: forget the ids seen from the old one.
  std::lock_guard lock(mu_);
  last_assigned_ = 0;
}


void JobWorker::report(const proto::JobUpdateT& update) {
  try {
    session_.send_job_update(update);
  } catch (const std::exception& e) {
    spdlog::warn("could not report job {}: {}", update.job_id, e.what());
  }
}

void JobWorker::run(const std::atomic<bool>& stop) {
  while (!stop.load()) {
    std::pair<uint64_t, std::vector<uint8_t>> job;
    {
      std::unique_lock lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(100), [&] { return !queue_.empty(); });
      if (queue_.empty()) continue;
      job = std::move(queue_.front());
      queue_.pop_front();
    }
    run_one(job.first, job.second, stop);
  }
}

void JobWorker::run_one(uint64_t id, const std::vector<uint8_t>& buffer,
                        const std::atomic<bool>& stop) {
  current_.store(id);
  cancel_.store(false);
  proto::JobUpdateT update;
  update.job_id = id;
  std::string name = "?";
  try {
    const proto::JobSpec* job = verify_job(buffer);
    name = job->name() ? job->name()->str() : "?";
    std::printf("job %llu '%s' started\n", (unsigned long long)id, name.c_str());
    std::fflush(stdout);
    LeaseAllocatorOptions lo;
    lo.budget_bytes = job_memory_budget(*job, session_.pool().size);
    auto leases = std::make_shared<LeaseAllocator>(session_, lo);
    JobResult result;
    {
      engine::AllocatorGuard guard(leases);
      JobRunOptions opts;
      opts.device = leases->device();
      // A cancel request, a lost session, or the agent stopping.
      opts.should_stop = [&] { return cancel_.load() || stop.load(); };
      opts.on_progress = [&](const JobProgress& p) {
        proto::JobUpdateT u;
        u.job_id = id;
        u.state = "running";
        u.progress = std::make_unique<proto::ProgressT>(to_progress(p));
        report(u);
      };
      opts.on_epoch = [&](const EpochReport& e) {
        proto::JobUpdateT u;
        u.job_id = id;
        u.state = "running";
        u.epoch = std::make_unique<proto::EpochStatT>();
        u.epoch->epoch = static_cast<int32_t>(e.epoch);
        u.epoch->train_loss = e.train_loss;
        u.epoch->test_accuracy = e.test_accuracy;
        u.epoch->seconds = e.seconds;
        report(u);
        std::printf("job %llu epoch %lld: test accuracy %.2f%%\n", (unsigned long long)id,
                    (long long)e.epoch, 100 * e.test_accuracy);
        std::fflush(stdout);
      };
      result = run_job(*job, opts);
    }
    update.state = "succeeded";
    update.test_accuracy = result.test_accuracy;
    update.samples_per_second = result.samples_per_second;
    std::printf("job %llu '%s' succeeded: test accuracy %.2f%%, %.0f samples/s, peak %s\n",
                (unsigned long long)id, name.c_str(), 100 * result.test_accuracy,
                result.samples_per_second, format_bytes(leases->stats().peak_in_use_bytes).c_str());
  } catch (const JobCancelled&) {
    update.state = "cancelled";
    update.reason = stop.load() ? "the agent is stopping"
                    : session_.connected() ? "cancelled by request"
                                           : "the agent lost its coordinator session";
    std::printf("job %llu '%s' cancelled: %s\n", (unsigned long long)id, name.c_str(),
                update.reason.c_str());
  } catch (const std::exception& e) {
    update.state = "failed";
    update.reason = e.what();
    std::printf("job %llu '%s' failed: %s\n", (unsigned long long)id, name.c_str(), e.what());
  }
  std::fflush(stdout);
  current_.store(0);
  report(update);
}

}  // namespace leasehold
