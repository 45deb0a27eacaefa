// Data-parallel scaling: one job of N replicas on N devices of one
// coordinator (one agent per device), for N in --replicas, each on a fresh
// coordinator, at a fixed per-replica batch: the job's training throughput
// (all replicas' samples/s, epochs only, no evaluation) against one replica's,
// and its test accuracy beside that of one replica at the same global batch
// (batch × N), which is the same training. Checkpoints are off (the PyTorch
// DDP reference, tests/bench/torch_ddp_train.py, writes none either).
//
//   leasehold-bench-data-parallel --job FILE [--replicas 1,2,4] [--epochs 3]
//                                 [--batch 256] [--backend cuda]
//                                 [--pool-size 16GiB] [--budget 8GiB]
//
// Prints a JSON line per run, then a table. On the host backend the
// devices are --host-devices N segments (Gloo), on cuda the first N GPUs
// (NCCL); counts above the devices visible are skipped.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "shared/device.h"
#include "tests/support/cluster.h"
#include "tests/support/job_client.h"

namespace lh = leasehold;
using nlohmann::json;

namespace {

struct Options {
  std::string job = "deploy/jobs/fashion-mnist-cnn.json";
  std::vector<int> replicas{1, 2, 4};
  int epochs = 3;
  int batch = 256;
  std::string backend = "cuda";
  std::string pool_size = "16GiB";
  std::string budget = "8GiB";
};

// One job of `replicas` replicas of `batch` samples each.
lh::testing::JobEnd run(const Options& o, int devices, int replicas, int batch) {
  lh::testing::Cluster c;
  std::vector<std::string> args{"--backend", o.backend, "--pool-size", o.pool_size,
                                "--heartbeat-interval", "500ms", "--mps", "off"};
  if (o.backend == "host") {
    args.insert(args.end(), {"--host-devices", std::to_string(devices)});
  } else {
    std::string list;
    for (int i = 0; i < devices; ++i) list += (i ? "," : "") + std::to_string(i);
    args.insert(args.end(), {"--devices", list});
  }
  c.start_coordinator(args);
  for (int i = 0; i < devices; ++i) {
    c.start_agent("agent-" + std::to_string(i), {"--device", std::to_string(i)});
  }
  if (!c.wait_for(
          [&](const json& s) { return lh::testing::idle_agents(s) == static_cast<size_t>(devices); },
          std::chrono::seconds(300))) {
    throw std::runtime_error("the agents did not stand by");
  }
  auto spec = lh::testing::read_job_file(o.job);
  spec->epochs = o.epochs;
  spec->steps = 0;
  spec->batch_size = batch;
  spec->replicas = replicas;
  spec->memory_budget = o.budget;
  spec->memory_min.clear();
  spec->device = o.backend == "host" ? "cpu" : "cuda";
  spec->name = "dp-" + std::to_string(replicas) + "x" + std::to_string(batch);
  spec->checkpoint = std::make_unique<lh::proto::CheckpointSpecT>();
  spec->checkpoint->enabled = false;
  lh::testing::JobClient client(c.endpoint());
  const uint64_t id = client.submit(*spec);
  auto ends = client.wait_ends({id}, std::chrono::seconds(3600));
  const auto& e = ends.at(id);
  if (e.state != "succeeded") {
    throw std::runtime_error(spec->name + " " + e.state + ": " + e.reason);
  }
  return e;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold-bench-data-parallel: one job over N devices, samples/s and accuracy"};
  Options o;
  app.add_option("--job", o.job, "job file")->capture_default_str();
  app.add_option("--replicas", o.replicas, "replica counts")->delimiter(',');
  app.add_option("--epochs", o.epochs, "epochs per job")->capture_default_str();
  app.add_option("--batch", o.batch, "samples per replica and step")->capture_default_str();
  app.add_option("--backend", o.backend, "cuda or host")->capture_default_str();
  app.add_option("--pool-size", o.pool_size, "each device's pool")->capture_default_str();
  app.add_option("--budget", o.budget, "each replica's memory_budget")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  try {
    const int visible = o.backend == "host" ? 64 : lh::cuda_device_count();
    std::vector<json> results;
    double one = 0;
    for (int n : o.replicas) {
      if (n > visible) {
        std::fprintf(stderr, "skipping %d replicas: %d devices visible\n", n, visible);
        continue;
      }
      const auto dp = run(o, n, n, o.batch);
      json r{{"job", o.job},
             {"replicas", n},
             {"batch_per_replica", o.batch},
             {"global_batch", n * o.batch},
             {"epochs", o.epochs},
             {"samples_per_second", dp.samples_per_second},
             {"test_accuracy", dp.test_accuracy}};
      if (n == 1) one = dp.samples_per_second;
      if (one > 0) r["speedup"] = dp.samples_per_second / one;
      if (n > 1) {
        // The same training on one device: the global batch at once.
        const auto single = run(o, 1, 1, n * o.batch);
        r["one_replica_same_global_batch"] = {{"samples_per_second", single.samples_per_second},
                                              {"test_accuracy", single.test_accuracy}};
      }
      std::printf("%s\n", r.dump().c_str());
      std::fflush(stdout);
      results.push_back(r);
    }
    std::printf("\n%8s  %12s  %14s  %8s  %10s  %22s\n", "replicas", "global batch",
                "samples/s", "speedup", "test acc", "1 device, same batch");
    for (const auto& r : results) {
      const bool same = r.contains("one_replica_same_global_batch");
      std::printf("%8d  %12d  %14.0f  %7.2fx  %9.2f%%  %21s\n", r["replicas"].get<int>(),
                  r["global_batch"].get<int>(), r["samples_per_second"].get<double>(),
                  r.value("speedup", 0.0), 100 * r["test_accuracy"].get<double>(),
                  same ? (std::to_string(
                              100 * r["one_replica_same_global_batch"]["test_accuracy"].get<double>())
                              .substr(0, 5) +
                          "%")
                             .c_str()
                       : "-");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-bench-data-parallel: %s\n", e.what());
    return 1;
  }
  return 0;
}
