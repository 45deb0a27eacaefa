// Queue benchmark: the coordinator loop's time per submission, per
// heartbeat and per job start as the queue grows to 100,000 jobs, measured
// in the core itself (coordinator/core.h) with a fake clock: the requests
// are decoded and handled exactly as the broker's loop does, without the
// sockets, the store's disk or the file checks' threads. Every figure is
// the median and the 99th percentile of the operations done at that queue
// length. Prints JSON.
//
//   leasehold-bench-queue [--sizes 1000,10000,100000] [--samples 200]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "shared/log.h"
#include "tests/support/core_driver.h"

namespace lh = leasehold;
using Clock = std::chrono::steady_clock;

namespace {

double us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  size_t i = std::min(v.size() - 1, static_cast<size_t>(p / 100.0 * (v.size() - 1) + 0.5));
  return v[i];
}

nlohmann::json figures(const std::vector<double>& samples) {
  return {{"p50_us", percentile(samples, 50)}, {"p99_us", percentile(samples, 99)}};
}

// One submission, handled as the loop handles it: the request, then its
// file check's result (the check itself runs on another thread).
uint64_t submit(lh::testing::CoreDriver& d, int n) {
  lh::proto::JobSpecT spec = lh::testing::CoreDriver::small_job("q" + std::to_string(n));
  lh::Effects e = d.request("client", "client", {}, lh::proto::Body::SubmitJob, [&](auto& fbb) {
    return lh::proto::CreateSubmitJob(fbb, lh::proto::JobSpec::Pack(fbb, &spec)).Union();
  });
  if (e.file_checks.size() != 1) throw std::runtime_error("refused: " + lh::testing::errors(e));
  lh::Effects done;
  d.core().file_check_done(e.file_checks[0].token, {}, d.now(), done);
  return done.messages.empty() ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold-bench-queue: coordinator loop time per operation by queue length"};
  std::string sizes_text = "1000,10000,100000";
  int samples = 200;
  app.add_option("--sizes", sizes_text, "queue lengths to measure at")->capture_default_str();
  app.add_option("--samples", samples, "operations timed at each length")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  lh::init_logging("error", "bench");
  std::vector<size_t> sizes;
  std::stringstream ss(sizes_text);
  for (std::string item; std::getline(ss, item, ',');) sizes.push_back(std::stoull(item));
  std::sort(sizes.begin(), sizes.end());

  lh::CoreOptions o = lh::testing::job_options();
  o.queued_per_user = 10'000'000;
  o.retention_count = 10'000'000;
  lh::testing::CoreDriver d(o, 64ull << 30);
  // A busy agent heart-beats with its job; the queue waits behind it.
  lh::testing::FakeAgent busy = d.register_agent("busy", 11);
  uint64_t running = 0;
  submit(d, 0);
  running = 1;
  d.heartbeat(busy, {{running, 1, lh::proto::JobPhase::Running}});

  nlohmann::json rows = nlohmann::json::array();
  int n = 1;
  for (size_t size : sizes) {
    while (d.core().jobs().queue().size() < size) submit(d, n++);
    std::vector<double> submits, heartbeats, starts;
    for (int i = 0; i < samples; ++i) {
      auto t0 = Clock::now();
      submit(d, n++);
      submits.push_back(us(Clock::now() - t0));
      t0 = Clock::now();
      lh::Effects hb = d.heartbeat(busy, {{running, 1, lh::proto::JobPhase::Running}});
      heartbeats.push_back(us(Clock::now() - t0));
      if (lh::testing::messages(hb, lh::proto::Body::HeartbeatAck).empty()) {
        throw std::runtime_error("heartbeat refused: " + lh::testing::errors(hb));
      }
      t0 = Clock::now();
      d.tick();
      d.advance(std::chrono::milliseconds(1));
      heartbeats.back() += us(Clock::now() - t0);  // the loop's tick beside it
    }
    // A job ends and the next starts from the head of the queue.
    for (int i = 0; i < samples / 4; ++i) {
      auto t0 = Clock::now();
      lh::Effects e = d.update(busy, running, 1, "succeeded");
      // Assigned at the latest on the heartbeat that shows the agent idle.
      lh::Effects h = d.heartbeat(busy, {});
      starts.push_back(us(Clock::now() - t0));
      auto a = lh::testing::assigned(e, busy);
      if (a.empty()) a = lh::testing::assigned(h, busy);
      if (a.empty()) throw std::runtime_error("no job started from the queue");
      running = a[0].first;
      d.heartbeat(busy, {{running, 1, lh::proto::JobPhase::Running}});
    }
    rows.push_back({{"queued", d.core().jobs().queue().size()},
                    {"submit", figures(submits)},
                    {"heartbeat_and_tick", figures(heartbeats)},
                    {"job_end_and_next_start", figures(starts)}});
    std::fprintf(stderr, "%zu queued: submit p50 %.1f us, heartbeat+tick p50 %.1f us\n", size,
                 percentile(submits, 50), percentile(heartbeats, 50));
  }
  nlohmann::json out{{"benchmark", "queue"}, {"jobs", d.core().jobs().all().size()}, {"rows", rows}};
  std::printf("%s\n", out.dump(2).c_str());
  return 0;
}
