// A coordinator that stalls (SIGSTOP for 3 s and 8 s: a VM pause, swapping,
// an fsync on a busy disk) interrupts no job: the agents keep their
// sessions and leases, and their jobs pause at most at a step boundary.
// The same with every core busy. A coordinator SIGKILLed and started again
// is another instance: its agents' leases are void and their jobs resume
// from their checkpoints, as before. Real processes, default heartbeat
// settings, the test backend (host in CI).
#include <gtest/gtest.h>
#include <signal.h>

#include <atomic>
#include <fstream>
#include <thread>

#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

// Busy loops on every core (and as many again) while alive.
class BusyCores {
 public:
  BusyCores() {
    const unsigned n = 2 * std::max(1u, std::thread::hardware_concurrency());
    for (unsigned i = 0; i < n; ++i) {
      threads_.emplace_back([this] {
        volatile uint64_t x = 0;
        while (!stop_.load(std::memory_order_relaxed)) x = x + 1;
      });
    }
  }
  ~BusyCores() {
    stop_.store(true);
    for (auto& t : threads_) t.join();
  }

 private:
  std::atomic<bool> stop_{false};
  std::vector<std::thread> threads_;
};

class PausedCoordinator : public ::testing::Test {
 protected:
  void SetUp() override {
    write_synthetic_idx(cluster.dir(), "train", 4000, 1);
    write_synthetic_idx(cluster.dir(), "test", 150, 2);
  }
  Process& start_coordinator() {
    return cluster.start_coordinator({"--backend", test_backend(), "--pool-size", "64MiB",
                                      "--alignment", "1MiB", "--policy", "fifo"});
  }
  uint64_t submit(const std::string& name) {
    const std::string file = cluster.dir() + "/" + name + ".json";
    std::ofstream(file) << synthetic_job_json(cluster.dir(), name,
                                              R"(, "epochs": 100000, "batch_size": 4)", 256);
    auto [rc, out] = cluster.client({"submit", file});
    EXPECT_EQ(rc, 0) << out;
    return rc == 0 ? std::stoull(out) : 0;
  }
  // The latest epoch job `id` reported (0: none yet).
  static int latest_epoch(const nlohmann::json& j) {
    return j["epochs"].empty() ? 0 : j["epochs"].back()["epoch"].get<int>();
  }
  // The job is running and reported epoch `epoch`.
  bool at_epoch(uint64_t id, int epoch, std::chrono::milliseconds timeout) {
    return cluster.wait_job(
        id,
        [&](const nlohmann::json& j) {
          return j["state"] == "running" && latest_epoch(j) >= epoch;
        },
        timeout);
  }
  void pause(Process& coordinator, std::chrono::milliseconds how_long) {
    coordinator.signal(SIGSTOP);
    std::this_thread::sleep_for(how_long);
    coordinator.signal(SIGCONT);
  }
  Cluster cluster;
};

TEST_F(PausedCoordinator, StallsOf3And8SecondsInterruptNoJobEvenWithEveryCoreBusy) {
  Process* coordinator = &start_coordinator();
  auto& a = cluster.start_agent("a", {});
  auto& b = cluster.start_agent("b", {});
  const uint64_t one = submit("one"), two = submit("two");
  ASSERT_TRUE(at_epoch(one, 1, 60s)) << a.log() << b.log();
  ASSERT_TRUE(at_epoch(two, 1, 60s)) << a.log() << b.log();

  auto uninterrupted = [&](const char* when) {
    for (uint64_t id : {one, two}) {
      const auto j = cluster.job(id);
      EXPECT_EQ(j["state"], "running") << when << j.dump(1);
      EXPECT_EQ(j["attempt_history"].size(), 1u) << when << j.dump(1);
    }
    for (auto* agent : {&a, &b}) {
      EXPECT_EQ(agent->log().find("lost:"), std::string::npos) << when << agent->log();
      EXPECT_EQ(agent->log().find("interrupted"), std::string::npos) << when << agent->log();
    }
  };
  for (auto stall : {3000ms, 8000ms}) {
    pause(*coordinator, stall);
    // Training goes on: another epoch is reported after the stall.
    const int epoch = latest_epoch(cluster.job(one));
    EXPECT_TRUE(at_epoch(one, epoch + 1, 60s)) << a.log();
    uninterrupted(stall == 3000ms ? "after 3 s: " : "after 8 s: ");
  }
  EXPECT_NE(coordinator->log().find("did not run for"), std::string::npos) << coordinator->log();
  {
    BusyCores busy;
    pause(*coordinator, 3000ms);
    std::this_thread::sleep_for(5s);  // a saturated host, heartbeats late
    const int epoch = latest_epoch(cluster.job(one));
    EXPECT_TRUE(at_epoch(one, epoch + 1, 120s)) << a.log();
  }
  uninterrupted("with every core busy: ");

  // A restart is not a pause: the new instance voids the old sessions, and
  // the jobs resume from their checkpoints.
  coordinator->signal(SIGKILL);
  ASSERT_TRUE(coordinator->wait(10s));
  coordinator = &start_coordinator();
  for (uint64_t id : {one, two}) {
    EXPECT_TRUE(cluster.wait_job(
        id,
        [](const nlohmann::json& j) {
          return j["state"] == "running" && j["resumed_from_epoch"] >= 1;
        },
        90s))
        << cluster.job(id).dump(1) << coordinator->log() << a.log() << b.log();
  }
  EXPECT_TRUE(a.wait_for_log("lost: another instance", 5s) ||
              a.wait_for_log("is not registered with this coordinator", 5s))
      << a.log();
  for (uint64_t id : {one, two}) {
    auto [rc, out] = cluster.client({"cancel", std::to_string(id)});
    EXPECT_EQ(rc, 0) << out;
  }
}

}  // namespace
}  // namespace leasehold::testing
