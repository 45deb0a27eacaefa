#include "tests/support/isolation.h"

#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <thread>

namespace leasehold::testing {

void run_isolation_scenario(Cluster& cluster, int agents, const std::string& lease_size) {
  const int leases_each = 3, rounds = 10;
  std::vector<Process*> procs;
  for (int i = 0; i < agents; ++i) {
    procs.push_back(&cluster.start_agent(
        "iso-" + std::to_string(i),
        {"--exercise", "--leases", std::to_string(leases_each), "--lease-size", lease_size,
         "--rounds", std::to_string(rounds), "--interval", "40ms"}));
  }
  bool all_leased = cluster.wait_for(
      [&](const nlohmann::json& s) {
        return s["leases"].size() == static_cast<size_t>(agents * leases_each);
      },
      std::chrono::seconds(10));
  ASSERT_TRUE(all_leased) << "agents did not all get their leases";
  auto s = cluster.status();
  ASSERT_TRUE(s);
  EXPECT_TRUE(leases_disjoint(*s)) << s->dump(2);
  for (int i = 0; i < agents; ++i) {
    EXPECT_EQ((*s)["agents"][i]["lease_count"], leases_each);
  }
  for (auto* p : procs) {
    auto rc = p->wait(std::chrono::seconds(30));
    ASSERT_TRUE(rc) << "agent still running:\n" << p->log();
    EXPECT_EQ(*rc, 0) << p->log();
    EXPECT_NE(p->log().find("verified round=" + std::to_string(rounds)), std::string::npos)
        << p->log();
    EXPECT_NE(p->log().find("exercise passed"), std::string::npos);
  }
  EXPECT_TRUE(cluster.wait_for([](const nlohmann::json& st) { return st["leases"].empty(); },
                               std::chrono::seconds(5)))
      << "leases left behind after the agents finished";
}

void run_stray_write_scenario(Cluster& cluster, const std::string& lease_size) {
  // The victims run until stopped: they hold their leases for as long as
  // the writer lives, so its target stays theirs.
  std::vector<Process*> victims;
  for (int i = 0; i < 2; ++i) {
    victims.push_back(&cluster.start_agent(
        "victim-" + std::to_string(i),
        {"--exercise", "--leases", "2", "--lease-size", lease_size, "--rounds", "0", "--interval",
         "50ms"}));
  }
  ASSERT_TRUE(cluster.wait_for(
      [](const nlohmann::json& s) { return s["leases"].size() == 4; }, std::chrono::seconds(20)));
  auto s = cluster.status();
  ASSERT_TRUE(s);
  const uint64_t target = (*s)["leases"][0]["offset"];
  auto& rogue = cluster.start_agent(
      "rogue", {"--exercise", "--leases", "1", "--lease-size", lease_size, "--rounds", "1",
                "--test-stray-write", std::to_string(target)});
  auto rc = rogue.wait(std::chrono::seconds(60));
  ASSERT_TRUE(rc) << "the writer still runs:\n" << rogue.log();
  EXPECT_NE(*rc, 0) << rogue.log();
  EXPECT_NE(rogue.log().find("outside this agent's leases"), std::string::npos) << rogue.log();
  EXPECT_EQ(rogue.log().find("the stray write went through"), std::string::npos) << rogue.log();
  // A few more rounds verified after the write, then stop.
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  for (auto* v : victims) v->signal(SIGTERM);
  for (auto* v : victims) {
    auto vrc = v->wait(std::chrono::seconds(60));
    ASSERT_TRUE(vrc) << "victim still running:\n" << v->log();
    EXPECT_EQ(*vrc, 0) << v->log();
    EXPECT_EQ(v->log().find("CORRUPTION"), std::string::npos) << v->log();
    EXPECT_NE(v->log().find("verified round=5"), std::string::npos) << v->log();
  }
}

}  // namespace leasehold::testing
