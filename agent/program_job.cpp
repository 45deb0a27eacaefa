#include "agent/program_job.h"

#include <dlfcn.h>
#include <spdlog/spdlog.h>
#include <sys/time.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <vector>

#include "agent/device_footprint.h"
#include "agent/program_process.h"
#include "lease_client/leasehold.h"
#include "shared/job_spec.h"
#include "shared/printable.h"

namespace leasehold {
namespace {

using Clock = std::chrono::steady_clock;

// Output goes to the coordinator in chunks of at most this many bytes (what
// one JobUpdate may carry), at least this often while the program writes.
constexpr size_t kChunkBytes = 64 << 10;
constexpr auto kChunkAge = std::chrono::milliseconds(250);
constexpr auto kOutsidePoolEvery = std::chrono::seconds(2);
// A job that has not reported its first step by then has its standby
// replaced anyway.
constexpr auto kRefillAfter = std::chrono::seconds(1);

uint64_t unix_us() {
  timeval tv{};
  ::gettimeofday(&tv, nullptr);
  return static_cast<uint64_t>(tv.tv_sec) * 1000000u + static_cast<uint64_t>(tv.tv_usec);
}

// The last `count` non-empty lines of standard error, joined by " | " and
// printable, for the failure's reason (one log line).
std::string last_lines(const std::string& text, size_t count) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < text.size()) {
    size_t nl = text.find('\n', start);
    if (nl == std::string::npos) nl = text.size();
    std::string line = text.substr(start, nl - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) lines.push_back(std::move(line));
    start = nl + 1;
  }
  std::string out;
  for (size_t i = lines.size() > count ? lines.size() - count : 0; i < lines.size(); ++i) {
    out += (out.empty() ? "" : " | ") + lines[i];
  }
  return printable(out, 900);
}

}  // namespace

void find_program_support(ProgramJobOptions& o, const char* argv0) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path bin = fs::canonical("/proc/self/exe", ec).parent_path();
  auto first_existing = [&](std::initializer_list<fs::path> candidates) -> std::string {
    for (const auto& c : candidates) {
      if (!c.empty() && fs::exists(c, ec)) return fs::canonical(c, ec).string();
    }
    return "";
  };
  if (o.python_dir.empty()) {
    const char* env = std::getenv("LEASEHOLD_PYTHON_DIR");
    o.python_dir = first_existing({env ? fs::path(env) : fs::path(),
                                   bin / "../share/leasehold/python",
#ifdef LEASEHOLD_SOURCE_DIR
                                   fs::path(LEASEHOLD_SOURCE_DIR) / "python"
#endif
                                  });
  }
  if (o.torch_plugin.empty()) {
    const char* env = std::getenv("LEASEHOLD_TORCH_PLUGIN");
    o.torch_plugin = first_existing(
        {env ? fs::path(env) : fs::path(), bin / "../lib/libleasehold_torch.so"});
  }
  spdlog::info("program jobs: Python package {}, PyTorch plug-in {} (agent {})",
               o.python_dir.empty() ? "none" : o.python_dir,
               o.torch_plugin.empty() ? "none" : o.torch_plugin, argv0);
}

ProgramJob::ProgramJob(AgentSession& session, ProgramJobOptions options)
    : session_(session),
      options_(std::move(options)),
      standbys_(options_.python_dir.empty() ? PythonStandbyOptions{} : options_.standby,
                agent_run()) {
  // The first standbys start at the worker's first idle moment, after the
  // agent's own warm-up has measured its footprint.
}

void ProgramJob::idle() { standbys_.fill(); }

ProgramRun ProgramJob::agent_run() const {
  const PoolDescriptor pool = session_.pool();
  ProgramRun run;
  auto& env = run.environment;
  env["LEASEHOLD_ENDPOINT"] = options_.endpoint;
  env["LEASEHOLD_AGENT"] = session_.name();
  // The program sees its job's GPU only, as cuda:0 (an unmodified script
  // uses "cuda" and lands on it); its lease client finds the pool on it by
  // UUID.
  const bool only_its_gpu = pool.backend == Backend::Cuda && !pool.uuid.empty();
  env["LEASEHOLD_DEVICE"] = pool.backend != Backend::Cuda ? "cpu"
                            : only_its_gpu                ? "cuda:0"
                                                          : "cuda:" + std::to_string(pool.device);
  if (only_its_gpu) env["CUDA_VISIBLE_DEVICES"] = pool.uuid;
  env["LEASEHOLD_REPORT_FD"] = "3";
  if (!options_.curve_key.empty()) env["LEASEHOLD_CURVE_KEY"] = options_.curve_key;
  if (!options_.curve_server_key.empty()) {
    env["LEASEHOLD_CURVE_SERVER_KEY"] = options_.curve_server_key;
  }
  if (!options_.torch_plugin.empty() && pool.backend == Backend::Cuda) {
    env["LEASEHOLD_TORCH_PLUGIN"] = options_.torch_plugin;
  }
  // The lease client this agent runs on, for a program that opens the
  // job's session without the plug-in (python/leasehold/regions.py on the
  // host backend).
  if (Dl_info info{}; ::dladdr(reinterpret_cast<void*>(&lh_session_open), &info) &&
                      info.dli_fname && info.dli_fname[0] == '/') {
    env["LEASEHOLD_CLIENT_LIB"] = info.dli_fname;
  }
  // Spilling's settings for PyTorch jobs (docs/program-jobs.md), as the
  // agent's environment gives them: LEASEHOLD_* names are the agent's.
  for (const char* name : {"LEASEHOLD_SPILL", "LEASEHOLD_SPILL_HOST_BYTES"}) {
    if (const char* v = std::getenv(name)) env[name] = v;
  }
  // The MPS daemon the agent joined (it set this before its first CUDA call).
  if (const char* mps = std::getenv("CUDA_MPS_PIPE_DIRECTORY")) {
    env["CUDA_MPS_PIPE_DIRECTORY"] = mps;
  }
  if (!options_.python_dir.empty()) {
    run.python_path = {options_.python_dir + "/leasehold_site", options_.python_dir};
  }
  run.stop_grace = options_.stop_grace;
  return run;
}

JobEnd ProgramJob::run(const proto::JobSpec& job, JobAttempt& a) {
  const PoolDescriptor pool = session_.pool();
  ProgramRun run = agent_run();
  auto& env = run.environment;
  env["LEASEHOLD_JOB_ID"] = std::to_string(a.id);
  env["LEASEHOLD_JOB_ATTEMPT"] = std::to_string(a.attempt);
  env["LEASEHOLD_JOB_NAME"] = a.name;
  env["LEASEHOLD_JOB_TOKEN"] = a.job_token;
  env["LEASEHOLD_BUDGET"] = std::to_string(job_memory_budget(job, pool.size));
  // Past it, the plug-in's growth is opportunistic (torch_plugin/growth_rule.h).
  env["LEASEHOLD_GUARANTEED"] = std::to_string(job_memory_min(job, pool.size));
  if (a.replica.data_parallel()) {
    // What torchrun gives each process, so that an unmodified DDP script
    // (init_process_group with the env:// rendezvous) runs: one process per
    // replica, each seeing its own GPU only, as device 0.
    env["RANK"] = std::to_string(a.replica.rank);
    env["WORLD_SIZE"] = std::to_string(a.replica.world_size);
    env["LOCAL_RANK"] = "0";
    env["LOCAL_WORLD_SIZE"] = "1";
    env["GROUP_RANK"] = std::to_string(a.replica.rank);
    env["MASTER_ADDR"] = a.replica.master_addr;
    env["MASTER_PORT"] = std::to_string(a.replica.master_port);
    // NVLink multicast stays off: several tenants share these GPUs.
    env["NCCL_NVLS_ENABLE"] = "0";
  }
  // Its checkpoint folder, checked (and the private one made, 0700) as an
  // engine job's is at every write: the program writes there itself.
  if (const auto* c = job.checkpoint(); c && c->enabled() && c->directory()) {
    CheckpointFolder folder(c->directory()->str(), a.checkpoint_owner, true);
    env["LEASEHOLD_CHECKPOINT_DIR"] = folder.path();
  }

  // Output, gathered into chunks.
  std::string pending;
  uint64_t pending_offset = 0;
  Clock::time_point pending_since{};
  auto flush_output = [&] {
    if (pending.empty()) return;
    proto::JobUpdateT u = a.update();
    u.log = std::move(pending);
    u.log_offset = pending_offset;
    pending.clear();
    a.reporter->reliable(std::move(u));
  };
  run.on_output = [&](std::string_view chunk, uint64_t offset) {
    if (a.replica.rank > 0) {
      // The job's log is rank 0's output; another replica's goes to its
      // agent's own output (the journal, under systemd).
      std::fwrite(chunk.data(), 1, chunk.size(), stderr);
      return;
    }
    if (pending.empty()) {
      pending_offset = offset;
      pending_since = Clock::now();
    }
    while (!chunk.empty()) {
      const size_t take = std::min(chunk.size(), kChunkBytes - pending.size());
      pending.append(chunk.substr(0, take));
      chunk.remove_prefix(take);
      if (pending.size() == kChunkBytes) {
        const uint64_t next = pending_offset + pending.size();
        flush_output();
        pending_offset = next;
        pending_since = Clock::now();
      }
    }
  };
  // Reports: progress, the first step, epochs.
  bool first = true;
  const auto started = Clock::now();
  run.should_stop = [&] {
    if (!pending.empty() && Clock::now() - pending_since >= kChunkAge) flush_output();
    a.at_step_boundary(nullptr, nullptr);  // a Shrink to the agent: it holds none of it
    // A standby taken is replaced once the job is under way: its warm-up
    // (import torch: seconds of a core) does not compete with the job's
    // own start.
    if (!first || Clock::now() - started >= kRefillAfter) standbys_.fill();
    return a.should_stop();
  };
  std::optional<proto::ProgramMemoryT> memory;
  std::optional<std::pair<Clock::time_point, int64_t>> last_samples;
  double samples_per_second = 0, last_accuracy = 0;
  Clock::time_point epoch_started = Clock::now();
  proto::ProgressT progress;
  auto send_progress = [&] {
    proto::JobUpdateT u = a.update();
    u.progress = std::make_unique<proto::ProgressT>(progress);
    if (memory) u.memory = std::make_unique<proto::ProgramMemoryT>(*memory);
    a.reporter->progress(std::move(u));
  };
  run.on_report = [&](const ProgramReport& r) {
    if (first) {
      first = false;
      proto::JobUpdateT u = a.update();
      u.first_step_at_us = unix_us();
      a.reporter->reliable(std::move(u));
    }
    if (r.step) progress.global_step = progress.step = *r.step;
    if (r.epoch) progress.epoch = static_cast<int32_t>(*r.epoch);
    if (r.loss) progress.loss = *r.loss;
    if (r.samples) {
      const auto now = Clock::now();
      if (last_samples && *r.samples > last_samples->second && now > last_samples->first) {
        samples_per_second = double(*r.samples - last_samples->second) /
                             std::chrono::duration<double>(now - last_samples->first).count();
        progress.samples_per_second = samples_per_second;
      }
      last_samples = {now, *r.samples};
    }
    a.position(progress.epoch, progress.global_step);
    if (r.test_accuracy) {
      last_accuracy = *r.test_accuracy;
      const int32_t epoch = r.epoch ? static_cast<int32_t>(*r.epoch) : progress.epoch;
      proto::JobUpdateT u = a.update();
      u.epoch = std::make_unique<proto::EpochStatT>();
      u.epoch->epoch = epoch;
      u.epoch->train_loss = r.loss ? *r.loss : progress.loss;
      u.epoch->test_accuracy = *r.test_accuracy;
      u.epoch->seconds = std::chrono::duration<double>(Clock::now() - epoch_started).count();
      epoch_started = Clock::now();
      a.reporter->reliable(std::move(u));
      say("job %llu epoch %d: test accuracy %.2f%%\n", (unsigned long long)a.id, epoch,
          100 * *r.test_accuracy);
    }
    send_progress();
  };
  // What the child allocated around its leases (its CUDA context, and any
  // library's own cudaMalloc), measured by NVML at most every few seconds:
  // an NVML query costs milliseconds.
  pid_t child = 0;
  std::optional<Clock::time_point> measured_at;
  uint64_t outside_pool = 0;
  run.on_start = [&](int pid) { child = pid; };
  run.on_memory = [&](const proto::ProgramMemoryT& m) {
    memory = m;
    if (pool.backend == Backend::Cuda && child > 0 &&
        (!measured_at || Clock::now() - *measured_at >= kOutsidePoolEvery)) {
      measured_at = Clock::now();
      if (auto bytes = process_device_bytes(engine::Device::cuda(pool.device), child)) {
        outside_pool = *bytes;
      }
    }
    memory->outside_pool_bytes = outside_pool;
    progress.peak_device_bytes = m.peak_leased_bytes;
    progress.spilled_bytes = m.spilled_bytes;
    progress.restored_bytes = m.restored_bytes;
    send_progress();
  };

  std::string cold;
  ProgramChild warm = standbys_.take(*job.program(), run, cold);
  if (warm) {
    say("job %llu runs warm in Python standby pid %d\n", (unsigned long long)a.id, warm.pid());
  } else if (standbys_.python().size()) {
    spdlog::info("job {} starts cold: {}", a.id, cold);
  }
  const ProgramOutcome out = warm ? supervise(warm, run) : run_program(*job.program(), run);
  flush_output();
  if (out.stopped) throw JobCancelled();
  JobEnd end;
  end.exit_code = out.exit_code;
  end.result.test_accuracy = last_accuracy;
  end.result.samples_per_second = samples_per_second;
  // Its last progress goes with the final report (a progress report sent
  // after it would come too late).
  end.result.memory.epoch = progress.epoch;
  end.result.memory.global_step = end.result.memory.step = progress.global_step;
  end.result.memory.loss = progress.loss;
  end.result.memory.samples_per_second = progress.samples_per_second;
  end.result.memory.peak_device_bytes = progress.peak_device_bytes;
  end.result.memory.spilled_bytes = progress.spilled_bytes;
  end.result.memory.restored_bytes = progress.restored_bytes;
  if (out.exit_code != 0) {
    const std::string tail = last_lines(out.stderr_tail, 5);
    end.failure = "exit status " + std::to_string(out.exit_code) +
                  (out.exit_code > 128 ? " (signal " + std::to_string(out.exit_code - 128) + ")"
                                       : "") +
                  (tail.empty() ? "" : ": " + tail);
    return end;
  }
  say("job %llu '%s' succeeded: the program exited with status 0\n", (unsigned long long)a.id,
      a.name.c_str());
  return end;
}

}  // namespace leasehold
