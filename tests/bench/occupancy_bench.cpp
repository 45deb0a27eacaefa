// Occupancy benchmark: N copies of some jobs (default: the two example jobs,
// MLP and LeNet, and the spill benchmark's CNN, each with its own epochs on
// the first --train-limit examples) whose unconstrained peaks oversubscribe
// the pool 2x and 4x, run four ways side by side in one run, each on a fresh
// coordinator and fresh agents that have finished starting:
//
// - sequential: one agent, the jobs one after another, each with the whole
//   pool (its budget: its peak, at most the pool);
// - policy: one agent per job, all submitted at once, occupancy policy, the
//   job files as the sequential run has them (budget: the peak, at most the
//   pool; no memory_min, so each job is guaranteed its budget and the policy
//   starts a job when its budget fits);
// - shares: the same with memory_min set so that the guarantees add up to
//   the pool: a small job (peak at most 1/8 of the pool) is guaranteed its
//   peak, the others share the rest in proportion to their peaks; each may
//   grow to its peak (all start at once and the large ones spill);
// - fifo: one agent per job, all at once, first come first served, each job
//   with its peak as budget: what happens without the policy.
//
// Prints per run the wall time from the first submission to the last job
// ending, the jobs that failed (and why), shrinks and time spent waiting for
// memory, and per job the time it was queued and the time it ran; then the
// policy runs' times against the sequential one. JSON lines, then a table.
//
// A job file may be a program job's (tests/bench/torch-lenet-program.json:
// PyTorch's LeNet through the plug-in, spilling past its share); it runs in
// the current folder, which must then be the source tree.
//
//   leasehold-bench-occupancy [--jobs A.json,B.json] [--copies 2]
//                             [--factors 2,4] [--train-limit 10240] [--epochs N]
//                             [--test-limit 2000] [--backend auto|host|cuda]
//                             [--modes sequential,policy,shares,fifo]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "shared/device.h"
#include "shared/units.h"
#include "tests/support/cluster.h"

namespace lh = leasehold;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

constexpr uint64_t kMiB = 1ull << 20;

struct Options {
  std::vector<std::string> jobs{"deploy/jobs/fashion-mnist-mlp.json",
                                "deploy/jobs/fashion-mnist-lenet.json",
                                "deploy/jobs/fashion-mnist-cnn-spill.json"};
  int copies = 2;
  int epochs = 0;  // 0: each job file's own
  std::vector<double> factors{2, 4};
  int train_limit = 10240, test_limit = 2000;
  std::string backend = "auto";
  std::string spill_host = "1GiB";
  std::string lease_wait = "10s";
  std::vector<std::string> modes{"sequential", "policy", "shares", "fifo"};

  bool runs(const std::string& mode) const {
    return std::find(modes.begin(), modes.end(), mode) != modes.end();
  }
};

std::string mib(uint64_t bytes) { return std::to_string((bytes + kMiB - 1) / kMiB) + "MiB"; }

json read_json(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  return json::parse(in);
}

// One job to submit: its file's contents, shortened, with memory settings.
// A program job (tests/bench/torch-lenet-program.json) runs as its file
// says, in this folder.
json prepare(json job, const Options& o, const std::string& name, uint64_t budget, uint64_t min) {
  job["name"] = name;
  if (job.contains("program")) {
    job["program"]["directory"] = std::filesystem::current_path().string();
  } else {
    if (o.epochs > 0) job["epochs"] = o.epochs;
    job.erase("steps");
    job["dataset"]["train_limit"] = o.train_limit;
    job["dataset"]["test_limit"] = o.test_limit;
    job["checkpoint"] = {{"enabled", false}};
  }
  job["memory_budget"] = mib(budget);
  if (min) job["memory_min"] = mib(min);
  return job;
}

struct Outcome {
  double seconds = 0;
  int succeeded = 0, failed = 0;
  uint64_t shrinks = 0, shrunk_bytes = 0, memory_wait_ms = 0, spilled_bytes = 0;
  std::vector<std::string> failures;
  std::vector<json> records;
  json per_job = json::array();  // name, seconds queued, seconds running
};

// A job's first start from its record's history (Unix ms; 0: never ran).
uint64_t started_ms(const json& job) {
  for (const auto& h : job["history"]) {
    if (h["state"] == "running") return h["at_ms"].get<uint64_t>();
  }
  return 0;
}

class Bench {
 public:
  explicit Bench(Options o) : o_(std::move(o)) {
    for (const auto& path : o_.jobs) files_.push_back(read_json(path));
  }

  // Starts a coordinator with `pool` bytes and `agents` agents.
  void start(lh::testing::Cluster& c, uint64_t pool, int agents, const std::string& policy) {
    c.start_coordinator({"--backend", o_.backend, "--pool-size", mib(pool), "--alignment", "2MiB",
                         "--heartbeat-interval", "500ms", "--policy", policy,
                         "--lease-wait-timeout", o_.lease_wait});
    for (int i = 0; i < agents; ++i) {
      c.start_agent("agent-" + std::to_string(i),
                    {"--spill-host-bytes", o_.spill_host, "--spill-staging-bytes", "64MiB"});
    }
    // Timing starts once every agent stands by (warmed up, its spill tier
    // pinned): the coordinator gives no job to one before.
    if (!c.wait_for([&](const json& s) { return static_cast<int>(lh::testing::idle_agents(s)) == agents; },
                    std::chrono::seconds(120))) {
      throw std::runtime_error("agents did not stand by");
    }
  }

  json jobs(lh::testing::Cluster& c) {
    auto [rc, out] = c.run("leasehold", {"--endpoint", c.endpoint(), "jobs", "-o", "json"});
    if (rc != 0) throw std::runtime_error("leasehold jobs: " + out);
    return json::parse(out);
  }

  // Submits `batch` at once and waits until every job has ended.
  Outcome run(lh::testing::Cluster& c, const std::vector<json>& batch) {
    auto t0 = Clock::now();
    int n = 0;
    for (const auto& job : batch) {
      std::string path = c.dir() + "/job-" + std::to_string(n++) + ".json";
      std::ofstream(path) << job.dump(2);
      auto [rc, out] = c.run("leasehold", {"--endpoint", c.endpoint(), "submit", path});
      if (rc != 0) throw std::runtime_error("submit " + path + ": " + out);
    }
    Outcome r;
    while (true) {
      json list = jobs(c);
      bool ended = static_cast<int>(list.size()) == n;
      for (const auto& j : list) {
        std::string s = j["state"];
        ended &= s != "queued" && s != "running";
      }
      if (ended) {
        r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
        for (const auto& j : list) {
          if (j["state"] == "succeeded") {
            ++r.succeeded;
          } else {
            ++r.failed;
            r.failures.push_back(j["name"].get<std::string>() + ": " +
                                 j["reason"].get<std::string>().substr(0, 160));
          }
          r.shrinks += j["shrinks"].get<uint64_t>();
          r.shrunk_bytes += j["shrunk_bytes"].get<uint64_t>();
          r.memory_wait_ms += j["memory_wait_ms"].get<uint64_t>();
          r.spilled_bytes += j["progress"]["spilled_bytes"].get<uint64_t>();
          const uint64_t submitted = j["submitted_ms"], started = started_ms(j),
                         finished = j["finished_ms"];
          auto secs = [](uint64_t from, uint64_t to) {
            return from && to > from ? static_cast<double>(to - from) / 1000 : 0.0;
          };
          r.per_job.push_back({{"name", j["name"]},
                               {"state", j["state"]},
                               {"queued_s", secs(submitted, started)},
                               {"ran_s", secs(started, finished)},
                               {"spilled_bytes", j["progress"]["spilled_bytes"]},
                               {"memory_wait_ms", j["memory_wait_ms"]},
                               {"shrinks", j["shrinks"]}});
          r.records.push_back(j);
        }
        return r;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }

  // Each job alone with a budget far above its needs: its unconstrained peak.
  std::vector<uint64_t> calibrate() {
    lh::testing::Cluster c;
    start(c, 8ull << 30, 1, "occupancy");
    std::vector<json> batch;
    for (size_t i = 0; i < o_.jobs.size(); ++i) {
      batch.push_back(prepare(files_[i], o_, "calibrate-" + std::to_string(i),
                              6ull << 30, 0));
    }
    Outcome r = run(c, batch);
    if (r.failed) throw std::runtime_error("calibration failed: " + r.failures[0]);
    std::vector<uint64_t> peaks;
    for (size_t i = 0; i < r.records.size(); ++i) {
      peaks.push_back(r.records[i]["progress"]["peak_device_bytes"]);
      std::fprintf(stderr, "alone: %s ran %.2f s, peak %s\n", o_.jobs[i].c_str(),
                   r.per_job[i]["ran_s"].get<double>(), lh::format_bytes(peaks.back()).c_str());
    }
    return peaks;
  }

  json measure(double factor, const std::vector<uint64_t>& peaks) {
    uint64_t total = 0;
    for (uint64_t p : peaks) total += p * o_.copies;
    const uint64_t pool = (static_cast<uint64_t>(total / factor) + 2 * kMiB - 1) / (2 * kMiB) * 2 * kMiB;
    const int n = static_cast<int>(peaks.size()) * o_.copies;
    // Guaranteed shares for the shares run, adding up to the pool (MiB
    // rounding down): small jobs get their peak (at a fraction of it their
    // non-spillable working set, such as a convolution's workspace, may not
    // fit), the rest share what is left.
    auto small = [&](uint64_t peak) { return peak <= pool / 8; };
    uint64_t small_total = 0, large_total = 0;
    for (uint64_t p : peaks) (small(p) ? small_total : large_total) += p * o_.copies;
    std::vector<uint64_t> guaranteed;
    for (uint64_t p : peaks) {
      double share = small(p) ? 1.0
                                    : static_cast<double>(pool - small_total) /
                                          static_cast<double>(large_total);
      guaranteed.push_back(std::max<uint64_t>(kMiB, static_cast<uint64_t>(p * share) / kMiB * kMiB));
    }
    auto batch = [&](bool with_min) {
      std::vector<json> out;
      for (int copy = 0; copy < o_.copies; ++copy) {
        for (size_t i = 0; i < o_.jobs.size(); ++i) {
          uint64_t budget = std::min(peaks[i], pool);
          uint64_t min = with_min ? guaranteed[i] : 0;
          out.push_back(prepare(files_[i], o_,
                                "j" + std::to_string(i) + "-" + std::to_string(copy), budget,
                                std::min(min, budget)));
        }
      }
      return out;
    };
    json result = {{"factor", factor}, {"jobs", n}, {"pool_bytes", pool}};
    auto record = [&](const char* mode, const Outcome& r) {
      result[mode] = {{"seconds", r.seconds},     {"succeeded", r.succeeded},
                      {"failed", r.failed},       {"failures", r.failures},
                      {"shrinks", r.shrinks},     {"shrunk_bytes", r.shrunk_bytes},
                      {"memory_wait_ms", r.memory_wait_ms}, {"spilled_bytes", r.spilled_bytes},
                      {"per_job", r.per_job}};
      std::fprintf(stderr, "factor %.0f %s: %.1f s, %d succeeded, %d failed\n", factor, mode,
                   r.seconds, r.succeeded, r.failed);
      for (const auto& j : r.per_job) {
        std::fprintf(stderr,
                     "  %-8s %-10s queued %6.2f s, ran %6.2f s, waited for memory %6.2f s, "
                     "spilled %s\n",
                     j["name"].get<std::string>().c_str(), j["state"].get<std::string>().c_str(),
                     j["queued_s"].get<double>(), j["ran_s"].get<double>(),
                     j["memory_wait_ms"].get<uint64_t>() / 1000.0,
                     lh::format_bytes(j["spilled_bytes"].get<uint64_t>()).c_str());
      }
    };
    // mode: its agents, its policy, whether the jobs carry memory_min.
    struct Mode {
      const char* name;
      int agents;
      const char* policy;
      bool with_min;
    };
    for (const Mode& m : {Mode{"sequential", 1, "occupancy", false},
                          Mode{"policy", n, "occupancy", false},
                          Mode{"shares", n, "occupancy", true}, Mode{"fifo", n, "fifo", false}}) {
      if (!o_.runs(m.name)) continue;
      lh::testing::Cluster c;
      start(c, pool, m.agents, m.policy);
      record(m.name, run(c, batch(m.with_min)));
    }
    if (result.contains("sequential")) {
      const double seq = result["sequential"]["seconds"].get<double>();
      for (const char* mode : {"policy", "shares"}) {
        if (result.contains(mode)) {
          result[std::string(mode) + "_vs_sequential"] = result[mode]["seconds"].get<double>() / seq;
        }
      }
    }
    return result;
  }

 private:
  Options o_;
  std::vector<json> files_;  // the job files, read once
};

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"leasehold-bench-occupancy: oversubscribed jobs, sequential vs policy vs fifo"};
  app.add_option("--jobs", o.jobs, "job files (copies of each make the batch)")->delimiter(',');
  app.add_option("--copies", o.copies, "copies of each job")->capture_default_str();
  app.add_option("--factors", o.factors, "oversubscription: sum of peaks / pool")
      ->delimiter(',');
  app.add_option("--train-limit", o.train_limit, "training examples per job and epoch")
      ->capture_default_str();
  app.add_option("--epochs", o.epochs, "epochs of every job (0: each job file's own)")
      ->capture_default_str();
  app.add_option("--test-limit", o.test_limit, "test examples per job")->capture_default_str();
  app.add_option("--backend", o.backend, "auto|host|cuda")->capture_default_str();
  app.add_option("--spill-host-bytes", o.spill_host, "each agent's pinned spill tier")
      ->capture_default_str();
  app.add_option("--lease-wait-timeout", o.lease_wait,
                 "the coordinators' default wait for memory (a job under fifo waits this long "
                 "before it fails)")
      ->capture_default_str();
  app.add_option("--modes", o.modes, "which runs: sequential, policy, shares, fifo")
      ->delimiter(',')
      ->check(CLI::IsMember({"sequential", "policy", "shares", "fifo"}));
  CLI11_PARSE(app, argc, argv);
  try {
    if (o.backend == "auto") o.backend = lh::cuda_device_count() > 0 ? "cuda" : "host";
    Bench bench(o);
    std::vector<uint64_t> peaks = bench.calibrate();
    json peaks_json = json::array();
    for (size_t i = 0; i < peaks.size(); ++i) {
      peaks_json.push_back({{"job", o.jobs[i]}, {"peak_bytes", peaks[i]}});
    }
    std::printf("%s\n", json({{"backend", o.backend}, {"peaks", peaks_json}}).dump().c_str());
    std::vector<json> results;
    for (double f : o.factors) {
      results.push_back(bench.measure(f, peaks));
      std::printf("%s\n", results.back().dump().c_str());
      std::fflush(stdout);
    }
    // The table: one row per factor, one column per mode that ran.
    auto cell = [](const json& r, const char* mode) -> std::string {
      if (!r.contains(mode)) return "-";
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.1f s (%d fail)", r[mode]["seconds"].get<double>(),
                    r[mode]["failed"].get<int>());
      return buf;
    };
    auto ratio = [](const json& r, const std::string& key) -> std::string {
      if (!r.contains(key)) return "-";
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2f", r[key].get<double>());
      return buf;
    };
    std::printf("\n%-7s %5s %10s %16s %16s %7s %16s %7s %16s\n", "factor", "jobs", "pool",
                "sequential", "policy", "ratio", "shares", "ratio", "fifo");
    for (const auto& r : results) {
      std::printf("%-7.0f %5d %10s %16s %16s %7s %16s %7s %16s\n", r["factor"].get<double>(),
                  r["jobs"].get<int>(), lh::format_bytes(r["pool_bytes"]).c_str(),
                  cell(r, "sequential").c_str(), cell(r, "policy").c_str(),
                  ratio(r, "policy_vs_sequential").c_str(), cell(r, "shares").c_str(),
                  ratio(r, "shares_vs_sequential").c_str(), cell(r, "fifo").c_str());
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-bench-occupancy: %s\n", e.what());
    return 1;
  }
  return 0;
}
