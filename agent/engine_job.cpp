#include "agent/engine_job.h"

#include <spdlog/spdlog.h>

#include <cmath>

#include "agent/engine/allocator.h"
#include "agent/lease_allocator.h"
#include "shared/job_spec.h"
#include "shared/units.h"

namespace leasehold {
namespace {

std::string spill_summary(const JobProgress& m) {
  if (!m.spilled_bytes) return "";
  return ", spilled " + format_bytes(m.spilled_bytes) + " and restored " +
         format_bytes(m.restored_bytes);
}

}  // namespace

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
  t.peak_device_bytes = p.peak_device_bytes;
  t.spill_host_bytes = p.spill_host_bytes;
  t.spill_file_bytes = p.spill_file_bytes;
  t.spilled_bytes = p.spilled_bytes;
  t.restored_bytes = p.restored_bytes;
  return t;
}

JobEnd EngineJob::run(const proto::JobSpec& job, JobAttempt& a) {
  LeaseAllocatorOptions lo =
      LeaseAllocatorOptions::for_budget(job_memory_budget(job, session_.pool().size));
  // Within its guaranteed share a lease may wait: the coordinator makes room.
  lo.guaranteed_bytes = job_memory_min(job, session_.pool().size);
  // Every device byte of the job comes from these leases; the allocator is
  // destroyed (fenced, then released) before the outcome is reported.
  auto leases = std::make_shared<LeaseAllocator>(session_, lo);
  engine::AllocatorGuard guard(leases);
  JobRunOptions opts;
  opts.device = leases->device();
  opts.session = &session_;
  opts.dataset_regions = options_.dataset_regions;
  opts.checkpoint_owner = a.checkpoint_owner;
  if (spill_) {
    opts.spill = spill_->for_job(job, "job" + std::to_string(a.id) + "-" + std::to_string(a.attempt),
                                 leases);
  }
  opts.at_step_boundary = [&, spill = opts.spill.get()] { a.at_step_boundary(leases.get(), spill); };
  opts.should_stop = a.should_stop;
  opts.memory_wanted = a.shrink_pending;
  opts.replica = a.replica;
  opts.replica_token = a.job_token;
  opts.stopping = a.stopping;
  opts.on_resume = [&](int64_t epoch) {
    a.resumed(epoch);
    a.reporter->reliable(a.update());
    say("job %llu resumes after epoch %lld\n", (unsigned long long)a.id, (long long)epoch);
  };
  opts.on_first_step = [&](uint64_t unix_us) {
    proto::JobUpdateT u = a.update();
    u.first_step_at_us = unix_us;
    a.reporter->reliable(std::move(u));
  };
  opts.on_progress = [&](const JobProgress& p) {
    a.position(p.epoch, p.global_step);
    proto::JobUpdateT u = a.update();
    u.progress = std::make_unique<proto::ProgressT>(to_progress(p));
    a.reporter->progress(std::move(u));
  };
  opts.on_epoch = [&](const EpochReport& e) {
    proto::JobUpdateT u = a.update();
    u.epoch = std::make_unique<proto::EpochStatT>();
    u.epoch->epoch = static_cast<int32_t>(e.epoch);
    u.epoch->train_loss = e.train_loss;
    u.epoch->test_accuracy = e.test_accuracy;
    u.epoch->seconds = e.seconds;
    u.epoch->checkpointed = e.checkpointed;
    u.epoch->validation_loss = e.validation_loss;
    a.reporter->reliable(std::move(u));
    if (e.validation_loss > 0) {
      say("job %llu epoch %lld: validation loss %.4f (%.3f bits/byte)\n",
          (unsigned long long)a.id, (long long)e.epoch, e.validation_loss,
          e.validation_loss / std::log(2.0));
    } else {
      say("job %llu epoch %lld: test accuracy %.2f%%\n", (unsigned long long)a.id,
          (long long)e.epoch, 100 * e.test_accuracy);
    }
  };
  JobEnd end;
  end.result = run_job(job, opts);
  say("job %llu '%s' succeeded: test accuracy %.2f%%, %.0f samples/s, peak %s%s\n",
      (unsigned long long)a.id, a.name.c_str(), 100 * end.result.test_accuracy,
      end.result.samples_per_second, format_bytes(end.result.memory.peak_device_bytes).c_str(),
      spill_summary(end.result.memory).c_str());
  return end;
}

}  // namespace leasehold
