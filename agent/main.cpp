// leasehold-agent: registers with the coordinator, maps its pool once and
// stays as a standby worker. With --exercise it leases memory and keeps
// verifying a pattern in it (the demo and the integration tests use this).
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <thread>

#include "agent/device_footprint.h"
#include "agent/engine/cuda_context.h"
#include "agent/exercise.h"
#include "agent/job_worker.h"
#include "agent/lease_allocator.h"
#include "agent/run_job_cli.h"
#include "agent/self_restart.h"
#include "agent/spill/agent_spill.h"
#include "agent/warmup.h"
#include "lease_client/session.h"
#include "shared/endpoint.h"
#include "shared/log.h"
#include "shared/signals.h"
#include "shared/units.h"

namespace {

std::string default_name() {
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  return std::string(host) + "-" + std::to_string(getpid());
}
}  // namespace

int main(int argc, char** argv) {
  // A throwaway child of a restarted agent: can a CUDA context be made now?
  if (argc == 3 && std::string(argv[1]) == "--probe-cuda-context") {
    return leasehold::probe_cuda_context(std::atoi(argv[2]));
  }
  CLI::App app{"leasehold-agent: a worker that leases memory from the leasehold coordinator"};
  leasehold::AgentOptions opts;
  opts.endpoint = leasehold::default_endpoint();
  opts.name = default_name();
  std::string log_level = "info", lease_size = "4MiB", interval = "200ms", register_timeout = "10s";
  bool exercise = false;
  leasehold::ExerciseOptions ex;
  app.add_option("--endpoint", opts.endpoint, "coordinator endpoint")->capture_default_str();
  std::string curve_key, curve_server_key;
  app.add_option(
      "--curve-key", curve_key,
      "this agent's CURVE key pair file, for a tcp:// endpoint (env LEASEHOLD_CURVE_KEY; "
      "made by `leasehold keygen`)");
  app.add_option("--curve-server-key", curve_server_key,
                 "the coordinator's CURVE public key file (env LEASEHOLD_CURVE_SERVER_KEY)");
  app.add_option("--name", opts.name, "agent name, unique per coordinator (default HOST-PID)");
  app.add_option("--device", opts.device,
                 "the device whose pool to work in (-1: the coordinator picks the one with the "
                 "fewest agents)");
  app.add_option("--register-timeout", register_timeout, "how long to try registering at start")
      ->capture_default_str();
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error")->capture_default_str();
  app.add_flag("--exercise", exercise, "lease memory and keep verifying a pattern in it");
  app.add_option("--leases", ex.leases, "exercise: leases to hold")
      ->capture_default_str()
      ->check(CLI::Range(1, 1024));
  app.add_option("--lease-size", lease_size, "exercise: size of each lease")->capture_default_str();
  app.add_option("--rounds", ex.rounds, "exercise: verify rounds (0: until stopped)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--interval", interval, "exercise: time between rounds")->capture_default_str();
  app.add_flag("--churn", ex.churn,
               "exercise: release the leases after every round and lease anew");
  app.add_option("--test-stray-write", ex.stray_write_offset,
                 "fault injection for tests: exercise writes 1 MiB at this pool offset, outside "
                 "its leases")
      ->group("");
  std::string job_file;
  leasehold::RunJobOverrides overrides;
  app.add_option("--run-job", job_file,
                 "run the training job in this JSON file inside this agent's leases, then exit")
      ->check(CLI::ExistingFile);
  app.add_option("--epochs", overrides.epochs, "with --run-job: replace the job's epochs");
  app.add_option("--train-limit", overrides.train_limit,
                 "with --run-job: train on the first N examples");
  app.add_option("--test-limit", overrides.test_limit,
                 "with --run-job: evaluate on the first N examples");
  bool op_by_op = false;
  app.add_flag("--no-cuda-graphs", op_by_op,
               "with --run-job: run every step op by op instead of as one CUDA graph");
  std::string gemm_choice = "measured";
  app.add_option("--gemm-choice", gemm_choice,
                 "how the engine's bfloat16 products pick cuBLASLt's algorithm: timed at their "
                 "first call (measured) or the heuristic's first (heuristic); the same results "
                 "either way")
      ->check(CLI::IsMember({"measured", "heuristic"}))
      ->capture_default_str();
  app.add_option("--mps-thread-percentage", opts.mps_thread_percentage,
                 "under MPS: the share of the GPU's threads this agent's kernels may use "
                 "(1-100; 0: all)")
      ->check(CLI::Range(0, 100))
      ->capture_default_str();
  leasehold::JobWorkerOptions worker_options;
  std::string dataset_regions = "on";
  app.add_option("--dataset-regions", dataset_regions,
                 "keep jobs' decoded datasets in shared cache regions of the pool, for the next "
                 "job on the same data (off: each job decodes its own into host memory)")
      ->check(CLI::IsMember({"on", "off"}))
      ->capture_default_str();
  auto& programs = worker_options.programs;
  app.add_option("--python-dir", programs.python_dir,
                 "the folder of Leasehold's Python package (leasehold/, leasehold_site/) put on "
                 "program jobs' PYTHONPATH (env LEASEHOLD_PYTHON_DIR; default: found beside the "
                 "agent)");
  app.add_option("--torch-plugin", programs.torch_plugin,
                 "the PyTorch plug-in (libleasehold_torch.so) program jobs load (env "
                 "LEASEHOLD_TORCH_PLUGIN; default: found beside the agent)");
  app.add_option("--python-standby", programs.standby.count,
                 "Python standbys kept warm for program jobs that run a Python script (torch "
                 "imported, the plug-in installed, the CUDA context made): such a job starts in "
                 "milliseconds (0: none; each holds a CUDA context outside the pool)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--python-standby-mode", programs.standby.mode,
                 "process: a job runs in its standby, warm to the CUDA context; fork: in a "
                 "child forked from it (torch imported, no CUDA context yet)")
      ->check(CLI::IsMember({"process", "fork"}))
      ->capture_default_str();
  app.add_option("--python-standby-preload", programs.standby.preload,
                 "modules the standbys import while warming up, comma-separated (such as "
                 "torchvision,transformers): jobs that import them start that much sooner");
  app.add_option("--python-standby-python", programs.standby.python,
                 "the standbys' interpreter (a path, or a name on the agent's PATH); jobs whose "
                 "command names the same one run warm")
      ->capture_default_str();
  std::string program_stop_grace = "10s";
  app.add_option("--program-stop-grace", program_stop_grace,
                 "how long a program job has after SIGTERM before SIGKILL")
      ->capture_default_str();
  bool& ignore_shrinks = worker_options.ignore_shrinks;
  app.add_flag("--test-ignore-shrinks", ignore_shrinks,
               "fault injection for tests: never answer the coordinator's Shrink requests")
      ->group("");  // hidden: not for operators
  app.add_option("--test-device-fault-job", worker_options.test_fault_job,
                 "fault injection for tests: jobs of this name make the GPU fault")
      ->group("");
  app.add_option("--test-device-fault-step", worker_options.test_fault_step,
                 "fault injection for tests: at this step of such a job")
      ->group("");
  std::string gpu_recovery = "120s";
  std::chrono::milliseconds recovery{};
  app.add_option("--gpu-recovery-timeout", gpu_recovery,
                 "after a device fault the agent starts itself again; this long it waits for "
                 "the GPU (under MPS: the server's recovery) to take new work")
      ->capture_default_str();
  leasehold::spill::SpillConfig spill;
  std::string spill_host = "256MiB", spill_staging = "64MiB", spill_file_limit = "0";
  app.add_option("--spill-host-bytes", spill_host,
                 "pinned host memory for spilled tensors, allocated at start (0: none)")
      ->capture_default_str();
  app.add_option("--spill-staging-bytes", spill_staging,
                 "pinned staging buffers for the spill file (0: no spill file)")
      ->capture_default_str();
  std::string state_dir;
  app.add_option("--state-dir", state_dir,
                 "this agent's state folder (spill files): default $STATE_DIRECTORY under "
                 "systemd, else agents/ENDPOINT under the user's state folder "
                 "(~/.local/state/leasehold/agents/ipc_…), one per coordinator");
  app.add_option("--spill-dir", spill.directory,
                 "directory of spill files (default: STATE_DIR/spill)");
  app.add_option("--spill-io-threads", spill.io_threads,
                 "threads reading and writing the spill file (requests in flight)")
      ->capture_default_str()
      ->check(CLI::Range(1, 64));
  app.add_option("--spill-file-limit", spill_file_limit,
                 "most bytes one job's spill file may hold (0: until the disk is full)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  overrides.cuda_graphs = !op_by_op;
  leasehold::engine::set_measured_gemm_choice(gemm_choice == "measured");

  try {
    leasehold::init_logging(log_level, "agent");
    ex.lease_size = leasehold::parse_bytes(lease_size);
    ex.interval = leasehold::parse_duration(interval);
    opts.register_timeout = leasehold::parse_duration(register_timeout);
    opts.curve = leasehold::client_curve_keys(opts.endpoint, curve_key, curve_server_key);
    programs.endpoint = opts.endpoint;
    programs.curve_key = curve_key;
    programs.curve_server_key = curve_server_key;
    programs.stop_grace = leasehold::parse_duration(program_stop_grace);
    leasehold::find_program_support(programs, argv[0]);
    recovery = leasehold::parse_duration(gpu_recovery);
    if (ex.lease_size == 0) throw std::invalid_argument("--lease-size must be positive");
    spill.host_bytes = leasehold::parse_bytes(spill_host);
    spill.staging_bytes = leasehold::parse_bytes(spill_staging);
    spill.file_limit = leasehold::parse_bytes(spill_file_limit);
    spill.validate();  // before registering: a bad setting never costs a session
    if (state_dir.empty()) state_dir = leasehold::default_agent_state_dir(opts.endpoint);
    spill.default_directory = state_dir + "/spill";
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-agent: %s\n", e.what());
    return 2;
  }

  if (opts.mps_thread_percentage > 0) {
    // Read by the CUDA driver when this process connects to MPS (its first
    // CUDA call, after registering).
    ::setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
             std::to_string(opts.mps_thread_percentage).c_str(), 1);
  }
  const std::atomic<bool>& stop = leasehold::install_stop_signals();
  std::optional<std::string> gpu_lost;
  std::optional<leasehold::engine::Device> gpu;  // once the pool is known to be on one
  const int restarts = leasehold::self_restarts();
  if (restarts >= leasehold::kMaxSelfRestarts) {
    spdlog::critical("the GPU failed {} starts in a row; giving up", restarts);
    return 1;
  }
  if (restarts > 0) {
    // The context of the process this one replaced was lost. Under MPS the
    // server takes new clients only once all its old ones are gone, and a
    // refused first CUDA call could never be retried in this process: wait
    // in probe children, before registering (it may take a while). Repeated
    // restarts back off first.
    for (int i = 0; i < std::min(restarts - 1, 10) * 10 && !stop.load(); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    if (std::getenv("CUDA_MPS_PIPE_DIRECTORY")) {
      try {
        leasehold::wait_for_cuda_context("/proc/self/exe", leasehold::restart_device(), recovery,
                                         stop);
      } catch (const std::exception& e) {
        spdlog::critical("{}", e.what());
        return 1;
      }
    }
  }

  try {
    // Only a standby worker takes jobs (not --exercise, not --run-job); it
    // gets none until it has warmed up.
    opts.takes_jobs = !exercise && job_file.empty();
    opts.interrupt = &stop;  // SIGTERM ends a wait for memory too
    opts.ready = !opts.takes_jobs;
    // The agent's environment is its own: it joins the coordinator's MPS
    // daemon (and its program jobs inherit that).
    opts.join_mps = true;
    leasehold::AgentSession session(opts);
    auto pool = session.pool();
    if (pool.backend == leasehold::Backend::Cuda) gpu = leasehold::pool_device(pool);
    std::printf("registered name=%s backend=%s pool_bytes=%llu\n", opts.name.c_str(),
                leasehold::backend_name(pool.backend), static_cast<unsigned long long>(pool.size));
    std::fflush(stdout);
    auto announce = [](const std::string& why) {
      if (why.empty()) {
        std::printf("re-registered\n");
      } else {
        std::printf("session lost: %s\n", why.c_str());
      }
      std::fflush(stdout);
    };
    if (exercise) {
      session.set_session_listener(announce);
      return leasehold::run_exercise(session, ex, stop);
    }
    const leasehold::engine::Device device = leasehold::pool_device(pool);
    // Set aside once, before any job: pinning host memory synchronizes the device.
    leasehold::spill::AgentSpill spiller(spill, device);
    if (!job_file.empty()) {
      session.set_session_listener(announce);
      return leasehold::run_job_file(session, job_file, overrides, stop, &spiller);
    }
    // Destroyed before the session: it removes its handlers from it first.
    worker_options.dataset_regions = dataset_regions == "on";
    leasehold::JobWorker worker(session, announce, &spiller, worker_options);
    {
      // On this thread, which runs the jobs: its stream and cuBLAS handle.
      leasehold::FootprintProbe probe(device);
      const auto t0 = std::chrono::steady_clock::now();
      leasehold::warm_up(device);
      const leasehold::Footprint footprint = probe.measure();
      session.set_ready(true, footprint.bytes);
      spdlog::info("warmed up in {} ms; {} of device memory outside the pool ({})",
                   std::chrono::duration_cast<std::chrono::milliseconds>(
                       std::chrono::steady_clock::now() - t0)
                       .count(),
                   leasehold::format_bytes(footprint.bytes), footprint.method);
    }
    spdlog::info(
        "standing by as '{}' for jobs{}", opts.name,
        leasehold::self_restarts() > 0
            ? " (restart " + std::to_string(leasehold::self_restarts()) + " after a device fault)"
            : std::string());
    leasehold::reset_self_restarts();  // the cap counts restarts in a row
    worker.run(stop);
    gpu_lost = worker.device_lost();
    if (gpu_lost) {
      spdlog::critical("GPU context lost ({}): reporting, then starting again", *gpu_lost);
    } else {
      spdlog::info("stopping");
    }
    // The interrupted job's report goes out while the session still exists.
    worker.finish(std::chrono::seconds(3));
  } catch (const std::exception& e) {
    if (stop.load()) {
      // SIGTERM or SIGINT while registering or waiting: an orderly end.
      spdlog::info("stopping: {}", e.what());
      return 0;
    }
    spdlog::critical("{}", e.what());
    // A context lost while warming up (or refused while the MPS server
    // recovers) is a restart too; anything else ends the agent.
    if (!gpu || !(gpu_lost = leasehold::engine::device_context_lost(*gpu)) || stop.load()) {
      return 1;
    }
  }
  if (gpu_lost && !stop.load()) {
    // Everything above has been unwound: the session unregistered.
    std::string why = leasehold::restart_self(argv, gpu ? gpu->index : -1);
    spdlog::critical("{}", why);
    return 1;
  }
  return 0;
}
