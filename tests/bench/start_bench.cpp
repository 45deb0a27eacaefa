// Job start benchmark: how long a job takes from its submission to its
// first training step, and to its end (PipeSwitch's point: a warm worker
// starts a task in milliseconds). One-step jobs of the example MLP
// (checkpoints off) submitted one after another, four ways side by side in
// one run, each on a fresh coordinator:
//
// - resident: a standby agent; the job's dataset is resident in its shared
//   cache region (a job before the measured ones filled it);
// - absent: the same, with the region dropped before each job (each job
//   decodes the files and fills it again);
// - private: a standby agent with --dataset-regions off: each job decodes
//   its own dataset into host memory and copies every batch over, as jobs
//   ran before regions existed;
// - cold: a new agent process per job, started right after the submission
//   (process start, CUDA context, pool mapping and warm-up), dataset resident.
//
// In every mode but cold one job runs unmeasured first. Submit -> first
// step is from the benchmark's clock just before SubmitJob to the agent's
// time stamp of the job's first step (one host, one clock); submit -> done
// to the job's final event on the PUB socket. Also reported: submit ->
// assigned (the coordinator's checks and its store commit) and the agent's
// own breakdown from its log (dataset, model, first step after the job's
// start). JSON lines, then a table.
//
//   leasehold-bench-start [--jobs 50] [--cold-jobs 50] [--job FILE]
//                         [--backend auto|host|cuda] [--pool-size 8GiB]
//                         [--modes resident,absent,private,cold]
#include <signal.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <regex>
#include <thread>

#include "shared/units.h"
#include "tests/support/cluster.h"
#include "tests/support/job_client.h"

namespace lh = leasehold;
using nlohmann::json;

namespace {

struct Options {
  int jobs = 50;
  int cold_jobs = 50;
  std::string job = "deploy/jobs/fashion-mnist-mlp.json";
  std::string backend = "auto";
  std::string pool_size = "8GiB";
  std::vector<std::string> modes{"resident", "absent", "private", "cold"};
};

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * (v.size() - 1) + 0.5));
  return v[i];
}

json summary(const std::vector<double>& v) {
  double mean = 0;
  for (double x : v) mean += x / static_cast<double>(v.size());
  return {{"p50", percentile(v, 50)},
          {"p99", percentile(v, 99)},
          {"mean", mean},
          {"min", v.empty() ? 0 : *std::min_element(v.begin(), v.end())},
          {"max", v.empty() ? 0 : *std::max_element(v.begin(), v.end())}};
}

// The times of one job (ms from its submission).
struct Timing {
  double assigned = 0, first_step = 0, done = 0;
};

class Bench {
 public:
  explicit Bench(Options o) : o_(std::move(o)), spec_(lh::testing::read_job_file(o_.job)) {
    spec_->epochs = 0;
    spec_->steps = 1;
    spec_->checkpoint = std::make_unique<lh::proto::CheckpointSpecT>();
    spec_->checkpoint->enabled = false;
  }

  json run(const std::string& mode) {
    lh::testing::Cluster c;
    c.start_coordinator({"--backend", o_.backend, "--pool-size", o_.pool_size,
                         "--heartbeat-interval", "500ms"});
    lh::testing::JobClient client(c.endpoint());
    std::vector<std::string> agent_args;
    if (mode == "private") agent_args = {"--dataset-regions", "off"};
    lh::testing::Process* agent = nullptr;
    if (mode != "cold") {
      agent = &c.start_agent("standby", agent_args);
      wait_standing_by(c, 1);
      submit_and_wait(client, "warm");  // unmeasured: fills the region
    } else {
      // A standby agent fills the region once, then goes away.
      auto& filler = c.start_agent("filler", {});
      wait_standing_by(c, 1);
      submit_and_wait(client, "warm");
      stop(filler);
    }
    const int n = mode == "cold" ? o_.cold_jobs : o_.jobs;
    std::vector<Timing> timings;
    for (int i = 0; i < n; ++i) {
      if (mode == "absent") client.drop_dataset_regions();
      const std::string name = "start-" + std::to_string(i);
      if (mode == "cold") {
        lh::testing::Process* cold = nullptr;
        timings.push_back(submit_and_wait(client, name, [&] {
          cold = &c.start_agent("cold-" + std::to_string(i), {});
        }));
        stop(*cold);
      } else {
        timings.push_back(submit_and_wait(client, name));
      }
    }
    std::vector<double> assigned, first, done;
    for (const auto& t : timings) {
      assigned.push_back(t.assigned);
      first.push_back(t.first_step);
      done.push_back(t.done);
    }
    json out{{"mode", mode},
             {"jobs", n},
             {"submit_to_assigned_ms", summary(assigned)},
             {"submit_to_first_step_ms", summary(first)},
             {"submit_to_done_ms", summary(done)}};
    if (agent) out["agent"] = agent_breakdown(agent->log());
    return out;
  }

 private:
  static void wait_standing_by(lh::testing::Cluster& c, size_t n) {
    if (!c.wait_for([&](const json& s) { return lh::testing::idle_agents(s) == n; },
                    std::chrono::seconds(120))) {
      throw std::runtime_error("the agent did not stand by");
    }
  }

  static void stop(lh::testing::Process& p) {
    p.signal(SIGTERM);
    if (!p.wait(std::chrono::seconds(30))) throw std::runtime_error("an agent did not stop");
  }

  // Submits a one-step job named `name`, calls `after_submit`, and waits for
  // its final event.
  Timing submit_and_wait(lh::testing::JobClient& client, const std::string& name,
                         const std::function<void()>& after_submit = {}) {
    spec_->name = name;
    const uint64_t t0 = lh::unix_time_us();
    const uint64_t id = client.submit(*spec_);
    if (after_submit) after_submit();
    const lh::testing::JobEnd end = client.wait_ends({id}, std::chrono::seconds(180)).at(id);
    if (end.state != "succeeded") {
      throw std::runtime_error("job " + name + " " + end.state + ": " + end.reason);
    }
    auto ms = [&](uint64_t at) { return (static_cast<double>(at) - static_cast<double>(t0)) / 1000.0; };
    return {ms(end.assigned_at_us), ms(end.first_step_at_us), ms(end.event_at_us)};
  }

  // Medians of the agent's own start phases, from its log lines
  // "job 'start-N': dataset A ms (...), model B ms, first step began C ms after the start
// (L leases by then)".
  static json agent_breakdown(const std::string& log) {
    std::regex re(R"(job 'start-\d+': dataset ([0-9.]+) ms \(([a-z]+)[^)]*\), model ([0-9.]+) ms, first step began ([0-9.]+) ms after the start \((\d+) leases)");
    std::vector<double> dataset, model, first, leases;
    std::string how;
    for (auto it = std::sregex_iterator(log.begin(), log.end(), re); it != std::sregex_iterator();
         ++it) {
      dataset.push_back(std::stod((*it)[1]));
      how = (*it)[2];
      model.push_back(std::stod((*it)[3]));
      first.push_back(std::stod((*it)[4]));
      leases.push_back(std::stod((*it)[5]));
    }
    std::regex re2(R"(picked up ([0-9.]+) ms after its assignment arrived, set up in ([0-9.]+) ms)");
    std::vector<double> picked, setup;
    for (auto it = std::sregex_iterator(log.begin(), log.end(), re2); it != std::sregex_iterator();
         ++it) {
      picked.push_back(std::stod((*it)[1]));
      setup.push_back(std::stod((*it)[2]));
    }
    return {{"jobs", dataset.size()},
            {"dataset", how},
            {"picked_up_ms_p50", percentile(picked, 50)},
            {"setup_ms_p50", percentile(setup, 50)},
            {"dataset_ms_p50", percentile(dataset, 50)},
            {"model_ms_p50", percentile(model, 50)},
            {"job_start_to_first_step_ms_p50", percentile(first, 50)},
            {"leases_by_first_step_p50", percentile(leases, 50)}};
  }

  Options o_;
  std::unique_ptr<lh::proto::JobSpecT> spec_;
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold-bench-start: submit -> first step and done, resident/absent/private/cold"};
  Options o;
  app.add_option("--jobs", o.jobs, "measured jobs per mode")->capture_default_str();
  app.add_option("--cold-jobs", o.cold_jobs, "measured jobs of the cold mode")->capture_default_str();
  app.add_option("--job", o.job, "job file (one step of it is run)")->capture_default_str();
  app.add_option("--backend", o.backend, "auto, host or cuda")->capture_default_str();
  app.add_option("--pool-size", o.pool_size, "the coordinator's pool")->capture_default_str();
  app.add_option("--modes", o.modes, "resident, absent, private, cold")->delimiter(',');
  CLI11_PARSE(app, argc, argv);
  try {
    Bench bench(o);
    std::vector<json> results;
    for (const auto& mode : o.modes) {
      results.push_back(bench.run(mode));
      std::printf("%s\n", results.back().dump().c_str());
      std::fflush(stdout);
    }
    std::printf("\n%-9s %5s  %-27s  %-27s  %-14s\n", "mode", "jobs",
                "submit->first step p50/p99", "submit->done p50/p99", "->assigned p50");
    double resident = 0, cold = 0;
    for (const auto& r : results) {
      const auto& f = r["submit_to_first_step_ms"];
      const auto& d = r["submit_to_done_ms"];
      std::printf("%-9s %5d  %10.2f / %8.2f ms  %10.2f / %8.2f ms  %10.2f ms\n",
                  r["mode"].get<std::string>().c_str(), r["jobs"].get<int>(),
                  f["p50"].get<double>(), f["p99"].get<double>(), d["p50"].get<double>(),
                  d["p99"].get<double>(), r["submit_to_assigned_ms"]["p50"].get<double>());
      if (r["mode"] == "resident") resident = f["p50"];
      if (r["mode"] == "cold") cold = f["p50"];
    }
    if (resident > 0 && cold > 0) {
      std::printf("cold / resident, submit->first step p50: %.1fx\n", cold / resident);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-bench-start: %s\n", e.what());
    return 1;
  }
  return 0;
}
