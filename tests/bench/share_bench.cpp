// Sharing benchmark: N copies of a job at once on N standby agents of one
// coordinator (one GPU), for N in --jobs-at-once, each run on a fresh
// coordinator: the jobs' total training throughput (the sum of each job's
// samples/s, epochs only, no evaluation) and the spread between them (min,
// max, and the smallest against the mean: fairness). Checkpoints are off
// (the PyTorch reference writes none either). For the MPS figures start a
// daemon and pass --coordinator-args "--mps-directory PIPE_DIR": each
// coordinator joins it and tells its agents (tests/gpu/run-share-checks.sh).
//
//   leasehold-bench-share --job FILE [--jobs-at-once 1,2,4,8,16] [--epochs 3]
//                         [--backend cuda] [--pool-size 32GiB]
//                         [--coordinator-args "..."] [--agent-args "..."]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/support/cluster.h"
#include "tests/support/job_client.h"

namespace lh = leasehold;
using nlohmann::json;

namespace {

struct Options {
  std::string job = "deploy/jobs/fashion-mnist-mlp.json";
  std::vector<int> at_once{1, 2, 4, 8, 16};
  int epochs = 3;
  std::string backend = "cuda";
  std::string pool_size = "32GiB";
  std::string coordinator_args, agent_args;
};

std::vector<std::string> words(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream ss(text);
  for (std::string w; ss >> w;) out.push_back(w);
  return out;
}

json run(const Options& o, int n) {
  lh::testing::Cluster c;
  std::vector<std::string> args{"--backend", o.backend, "--pool-size", o.pool_size,
                                "--heartbeat-interval", "500ms"};
  for (auto& w : words(o.coordinator_args)) args.push_back(w);
  c.start_coordinator(args);
  for (int i = 0; i < n; ++i) c.start_agent("agent-" + std::to_string(i), words(o.agent_args));
  if (!c.wait_for([&](const json& s) { return lh::testing::idle_agents(s) == static_cast<size_t>(n); },
                  std::chrono::seconds(300))) {
    throw std::runtime_error("the agents did not stand by");
  }
  auto spec = lh::testing::read_job_file(o.job);
  spec->epochs = o.epochs;
  spec->steps = 0;
  spec->checkpoint = std::make_unique<lh::proto::CheckpointSpecT>();
  spec->checkpoint->enabled = false;
  lh::testing::JobClient client(c.endpoint());
  std::vector<uint64_t> ids;
  for (int i = 0; i < n; ++i) {
    spec->name = "share-" + std::to_string(i);
    ids.push_back(client.submit(*spec));
  }
  auto ends = client.wait_ends(ids, std::chrono::seconds(1800));
  std::vector<double> rates;
  for (const auto& [id, e] : ends) {
    if (e.state != "succeeded") {
      throw std::runtime_error("job " + std::to_string(id) + " " + e.state + ": " + e.reason);
    }
    rates.push_back(e.samples_per_second);
  }
  double total = 0;
  for (double r : rates) total += r;
  const double mean = total / rates.size();
  const double min = *std::min_element(rates.begin(), rates.end());
  return {{"jobs_at_once", n},
          {"total_samples_per_second", total},
          {"min", min},
          {"max", *std::max_element(rates.begin(), rates.end())},
          {"min_over_mean", min / mean},
          {"rates", rates}};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold-bench-share: N jobs at once on N standby agents, total samples/s"};
  Options o;
  app.add_option("--job", o.job, "job file")->capture_default_str();
  app.add_option("--jobs-at-once", o.at_once, "job counts")->delimiter(',');
  app.add_option("--epochs", o.epochs, "epochs per job")->capture_default_str();
  app.add_option("--backend", o.backend, "cuda or host")->capture_default_str();
  app.add_option("--pool-size", o.pool_size, "the coordinator's pool")->capture_default_str();
  app.add_option("--coordinator-args", o.coordinator_args, "more coordinator arguments");
  app.add_option("--agent-args", o.agent_args, "more agent arguments");
  CLI11_PARSE(app, argc, argv);
  try {
    std::vector<json> results;
    for (int n : o.at_once) {
      results.push_back(run(o, n));
      results.back()["job"] = o.job;
      std::printf("%s\n", results.back().dump().c_str());
      std::fflush(stdout);
    }
    std::printf("\n%6s  %14s  %12s  %12s  %9s\n", "jobs", "total samp/s", "min", "max",
                "min/mean");
    for (const auto& r : results) {
      std::printf("%6d  %14.0f  %12.0f  %12.0f  %9.2f\n", r["jobs_at_once"].get<int>(),
                  r["total_samples_per_second"].get<double>(), r["min"].get<double>(),
                  r["max"].get<double>(), r["min_over_mean"].get<double>());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-bench-share: %s\n", e.what());
    return 1;
  }
  return 0;
}
