// A paused agent (SIGSTOP: a debugger, a VM pause, a host swapping) never
// writes into memory that was handed to someone else. Real processes on the
// test backend (host in CI, cuda on a GPU host): an exercise agent and a
// training agent are stopped for 2x and 5x recovery_grace while neighbours
// keep leasing whatever memory the pool frees and checking their patterns
// in it, then continued. With end_silent_agents the coordinator kills both
// and reuses their memory only once they have exited; without it their
// memory stays fenced, and on waking they touch none of it again (their own
// clock and the lost session stop them) before the coordinator lets it go.
// Either way no pattern is disturbed and the job resumes from its
// checkpoint on another agent.
#include <gtest/gtest.h>
#include <signal.h>

#include <fstream>
#include <thread>

#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

constexpr auto kGrace = 1s;

struct Pause {
  bool end_silent_agents;
  int graces;  // how long the agents stay stopped, in recovery_grace
};

std::string name_of(const ::testing::TestParamInfo<Pause>& p) {
  return std::string(p.param.end_silent_agents ? "Killed" : "Fenced") + "After" +
         std::to_string(p.param.graces) + "Graces";
}

class PausedAgent : public ::testing::TestWithParam<Pause> {
 protected:
  void SetUp() override {
    write_synthetic_idx(cluster.dir(), "train", 4000, 1);
    write_synthetic_idx(cluster.dir(), "test", 150, 2);
    // First come, first served: whatever memory frees goes to whoever waits
    // (the occupancy policy's admission is not what this tests).
    coordinator = &cluster.start_coordinator(
        {"--backend", test_backend(), "--pool-size", "64MiB", "--alignment", "1MiB", "--policy",
         "fifo",
         "--heartbeat-interval", "200ms", "--recovery-grace", "1s", "--end-silent-agents",
         GetParam().end_silent_agents ? "true" : "false"});
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    return cluster.client(std::move(args));
  }
  nlohmann::json job(uint64_t id) { return cluster.job(id); }
  bool wait_job(uint64_t id, const std::function<bool(const nlohmann::json&)>& pred,
                std::chrono::milliseconds timeout) {
    return cluster.wait_job(id, pred, timeout);
  }
  Cluster cluster;
  Process* coordinator = nullptr;
};

TEST_P(PausedAgent, WritesIntoNoMemoryOfAnotherAndItsJobResumes) {
  const Pause pause = GetParam();
  auto& trainer = cluster.start_agent("trainer", {});
  const std::string file = cluster.dir() + "/long.json";
  std::ofstream(file) << synthetic_job_json(cluster.dir(), "long",
                                            R"(, "epochs": 100000, "batch_size": 16)", 256);
  auto [rc, out] = client({"submit", file});
  ASSERT_EQ(rc, 0) << out;
  const uint64_t id = std::stoull(out);
  // A checkpoint exists before the pause: the job resumes from it.
  ASSERT_TRUE(trainer.wait_for_log("job " + std::to_string(id) + " epoch 1:", 60s))
      << trainer.log() << coordinator->log();
  auto& heir = cluster.start_agent("heir", {});
  auto& sleeper = cluster.start_agent(
      "sleeper", {"--exercise", "--leases", "2", "--lease-size", "8MiB", "--rounds", "0",
                  "--interval", "20ms"});
  ASSERT_TRUE(sleeper.wait_for_log("verified round=", 10s)) << sleeper.log();
  std::vector<std::pair<uint64_t, uint64_t>> slept_in;  // the sleeper's leases
  const auto before = cluster.status();
  ASSERT_TRUE(before);
  for (const auto& l : (*before)["leases"]) {
    if (l["agent"] == "sleeper") slept_in.emplace_back(l["offset"], l["size"]);
  }
  ASSERT_EQ(slept_in.size(), 2u);
  // Neighbours that with the sleeper and the job want all of the pool and
  // more: whatever it frees is granted to a waiting one, and patterned and
  // checked there.
  std::vector<Process*> neighbours;
  for (int i = 0; i < 3; ++i) {
    neighbours.push_back(&cluster.start_agent(
        "neighbour" + std::to_string(i), {"--exercise", "--churn", "--leases", "2",
                                          "--lease-size", "8MiB", "--rounds", "0",
                                          "--interval", "10ms"}));
  }
  ASSERT_TRUE(neighbours[0]->wait_for_log("verified round=", 10s)) << neighbours[0]->log();

  sleeper.signal(SIGSTOP);
  trainer.signal(SIGSTOP);
  const auto stopped = std::chrono::steady_clock::now();
  // While they are stopped their memory is fenced: status says so.
  EXPECT_TRUE(cluster.wait_for(
      [](const nlohmann::json& s) {
        bool sleeper = false;
        for (const auto& f : s["fences"]) sleeper |= f["agent"] == "sleeper";
        return sleeper;
      },
      5s))
      << cluster.status()->dump(1);
  std::this_thread::sleep_until(stopped + pause.graces * kGrace);
  if (!pause.end_silent_agents) {
    const auto s = cluster.status();
    ASSERT_TRUE(s);
    bool held = false;
    for (const auto& f : (*s)["fences"]) {
      held |= f["agent"] == "sleeper" &&
              f["state"].get<std::string>().find("end_silent_agents is off") != std::string::npos;
    }
    EXPECT_TRUE(held) << s->dump(1);
    EXPECT_TRUE(sleeper.running()) << "never killed when end_silent_agents is off";
  }
  sleeper.signal(SIGCONT);
  trainer.signal(SIGCONT);

  // The job goes on from its checkpoint on the heir.
  EXPECT_TRUE(wait_job(
      id, [](const auto& j) { return j["state"] == "running" && j["agent"] == "heir"; }, 30s))
      << job(id).dump(1) << coordinator->log();
  auto j = job(id);
  ASSERT_GE(j["attempt_history"].size(), 2u) << j.dump(1);
  EXPECT_EQ(j["attempt_history"][0]["agent"], "trainer");
  EXPECT_EQ(j["attempt_history"][0]["outcome"], "agent lost") << j.dump(1);
  EXPECT_TRUE(wait_job(id, [](const auto& j) { return j["resumed_from_epoch"] >= 1; }, 30s))
      << job(id).dump(1) << heir.log();

  if (pause.end_silent_agents) {
    // Killed while stopped (SIGKILL ends a stopped process), then reused.
    auto sleeper_rc = sleeper.wait(10s);
    ASSERT_TRUE(sleeper_rc) << sleeper.describe() << coordinator->log();
    EXPECT_EQ(*sleeper_rc, 128 + SIGKILL) << sleeper.log();
    auto trainer_rc = trainer.wait(10s);
    ASSERT_TRUE(trainer_rc) << trainer.describe();
    EXPECT_EQ(*trainer_rc, 128 + SIGKILL) << trainer.log();
    EXPECT_NE(coordinator->log().find("'sleeper' (pid"), std::string::npos);
    EXPECT_NE(coordinator->log().find("sent it SIGKILL"), std::string::npos) << coordinator->log();
  } else {
    // Awake, it noticed the silence and its lost session, let go of its
    // old leases, registered again and exercises new ones.
    EXPECT_TRUE(sleeper.wait_for_log("re-registered", 10s)) << sleeper.log();
    const auto resumed = sleeper.log().size();
    ASSERT_TRUE(cluster.wait_for(
        [&](const nlohmann::json&) {
          return sleeper.log().find("verified round=", resumed) != std::string::npos;
        },
        15s))
        << sleeper.log();
    EXPECT_NE(coordinator->log().find("stay held until it exits"), std::string::npos)
        << coordinator->log();
    EXPECT_TRUE(cluster.wait_for(
        [](const nlohmann::json& s) { return s["fences"].empty(); }, 15s))
        << cluster.status()->dump(1);
    EXPECT_TRUE(trainer.running()) << trainer.log();
    // Awake, it may well lease its old memory again: let it go, so that the
    // neighbours take it.
    sleeper.signal(SIGTERM);
    ASSERT_TRUE(sleeper.wait(10s)) << sleeper.describe();
  }
  // The sleeper's old memory went to someone else, who keeps checking it.
  EXPECT_TRUE(cluster.wait_for(
      [&](const nlohmann::json& s) {
        for (const auto& l : s["leases"]) {
          const uint64_t off = l["offset"], size = l["size"];
          for (auto [o, n] : slept_in) {
            if (l["agent"] != "sleeper" && off < o + n && o < off + size) return true;
          }
        }
        return false;
      },
      20s))
      << cluster.status()->dump(1);
  // The neighbours ran on through it all, every pattern intact.
  std::this_thread::sleep_for(1s);
  for (auto* n : neighbours) {
    EXPECT_TRUE(n->running()) << n->log();
    EXPECT_EQ(n->log().find("CORRUPTION"), std::string::npos) << n->log();
  }
  for (auto* p : {&sleeper, &trainer, &heir}) {
    EXPECT_EQ(p->log().find("CORRUPTION"), std::string::npos) << p->log();
  }
  const auto s = cluster.status();
  ASSERT_TRUE(s);
  EXPECT_TRUE(leases_disjoint(*s)) << s->dump(1);
  auto [crc, cout_] = client({"cancel", std::to_string(id)});
  EXPECT_EQ(crc, 0) << cout_;
}

INSTANTIATE_TEST_SUITE_P(Pauses, PausedAgent,
                         ::testing::Values(Pause{true, 2}, Pause{true, 5}, Pause{false, 2},
                                           Pause{false, 5}),
                         name_of);

}  // namespace
}  // namespace leasehold::testing
