// The occupancy policy end to end, with real processes (on the host
// backend; $LEASEHOLD_TEST_BACKEND=cuda on a GPU host): three jobs whose unconstrained peaks add up
// to twice the pool, submitted at once to three agents, all finish with the accuracy each reaches
// alone; an agent that never answers Shrink does not wedge the coordinator.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <iomanip>
#include <thread>

#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
constexpr uint64_t MiB = 1ull << 20;

// Activation-heavy and parameter-light (as in the spill test): its peak is
// the saved ReLU outputs of the whole batch, eight of them (dropout keeps
// no mask: its backward draws it again), so that a step's peak is many
// times one activation.
std::string job_json(const std::string& data_dir, const std::string& name, int epochs, int seed,
                     const std::string& memory) {
  std::string model = R"("model": [{"type": "Flatten"}, {"type": "Linear", "in": 64, "out": 1024})";
  for (int i = 0; i < 8; ++i) model += R"(, {"type": "ReLU"}, {"type": "Dropout", "p": 0.1})";
  model += R"(, {"type": "Linear", "in": 1024, "out": 3}],)";
  std::string json = synthetic_job_json(
      data_dir, name, R"(, "batch_size": 600, "epochs": )" + std::to_string(epochs) + memory);
  size_t a = json.find(R"("model")"), b = json.find(R"("dataset")");
  json.replace(a, b - a, model + " ");
  size_t s = json.find(R"("seed": 3)");
  json.replace(s, 9, R"("seed": )" + std::to_string(seed));
  return json;
}

struct Job {
  std::string name;
  int epochs;
  int seed;
};
// A ends first; B runs longest, so it is still running (and past its
// guaranteed share) when C starts. On a GPU an epoch of B takes a few
// milliseconds and 25 of them could end before C started, so B trains
// longer there. Even so, on an H100 C fits beside what B still holds in
// about one run in four and nobody shrinks (see the README).
std::vector<Job> jobs_to_run() {
  return {{"a", 2, 3}, {"b", test_backend() == "cuda" ? 300 : 25, 4}, {"c", 3, 5}};
}

class Oversubscribed : public ::testing::Test {
 protected:
  void SetUp() override {
    write_synthetic_idx(data.dir(), "train", 3000, 1);
    write_synthetic_idx(data.dir(), "test", 300, 2);
  }

  std::string write_job(Cluster& c, const Job& j, const std::string& memory) {
    std::string path = c.dir() + "/" + j.name + ".json";
    std::ofstream(path) << job_json(data.dir(), j.name, j.epochs, j.seed, memory);
    return path;
  }
  std::pair<int, std::string> client(Cluster& c, std::vector<std::string> args) {
    args.insert(args.begin(), {"--endpoint", c.endpoint()});
    return c.run("leasehold", args);
  }
  nlohmann::json jobs(Cluster& c) {
    auto [rc, out] = client(c, {"jobs", "-o", "json"});
    EXPECT_EQ(rc, 0) << out;
    return rc == 0 ? nlohmann::json::parse(out) : nlohmann::json::array();
  }
  static std::string memory(uint64_t min_mib, uint64_t budget_mib) {
    return R"(, "memory_min": ")" + std::to_string(min_mib) + R"(MiB", "memory_budget": ")" +
           std::to_string(budget_mib) + R"(MiB")";
  }

  // Each job alone with all the memory it wants: its accuracy and the
  // largest peak (the jobs share a model and a batch size).
  void run_alone() {
    Cluster solo;
    solo.start_coordinator({"--backend", test_backend(), "--pool-size", "512MiB", "--alignment",
                            "1MiB", "--heartbeat-interval", "200ms"});
    solo.start_agent("solo", {});
    for (const Job& j : jobs_to_run()) {
      auto [rc, out] = client(
          solo, {"submit", write_job(solo, j, R"(, "memory_budget": "256MiB")"), "--follow"});
      ASSERT_EQ(rc, 0) << out;
    }
    for (const auto& j : jobs(solo)) {
      alone_accuracy[j["name"]] = j["test_accuracy"].get<double>();
      alone_losses[j["name"]] = losses(j);
      peak = std::max(peak, j["progress"]["peak_device_bytes"].get<uint64_t>());
      EXPECT_EQ(j["progress"]["spilled_bytes"], 0) << j.dump(2);
    }
    ASSERT_GT(peak, 16 * MiB);
  }

  // Starts a coordinator whose pool is two thirds of the three peaks, and
  // the agents (in name order they take the jobs in queue order).
  void start_oversubscribed(Cluster& c, const std::vector<std::pair<std::string, bool>>& agents) {
    peak_mib = (peak + MiB - 1) / MiB;
    pool_mib = (3 * peak_mib + 1) / 2;
    c.start_coordinator({"--backend", test_backend(), "--pool-size",
                         std::to_string(pool_mib) + "MiB", "--alignment", "1MiB",
                         "--heartbeat-interval", "200ms", "--shrink-timeout", "500ms"});
    for (const auto& [name, ignores] : agents) {
      std::vector<std::string> args;
      if (ignores) args.push_back("--test-ignore-shrinks");
      c.start_agent(name, args);
    }
    // Standing by (warmed up), so that they take the jobs in name order.
    ASSERT_TRUE(c.wait_for([&](const auto& s) { return idle_agents(s) == agents.size(); }, 30s));
  }

  // Submits the three at once: A is guaranteed 30% of the pool (its budget,
  // so it spills), B 10% and grows (to 50% beside A's share, below the low
  // watermark), C its whole peak (which does not fit beside A and B's
  // shares: it waits for A, then needs some of what B grew into).
  // `b_epochs`: B's epochs when not its usual.
  void submit_all(Cluster& c, int b_epochs = 0) {
    uint64_t a = pool_mib * 3 / 10, b = pool_mib / 10;
    const std::string mem[] = {memory(a, a), memory(b, peak_mib), memory(peak_mib, peak_mib)};
    for (int i = 0; i < 3; ++i) {
      Job j = jobs_to_run()[i];
      if (i == 1 && b_epochs) j.epochs = b_epochs;
      auto [rc, out] = client(c, {"submit", write_job(c, j, mem[i])});
      ASSERT_EQ(rc, 0) << out;
    }
  }

  // What polling saw: the most bytes ever leased, the pool's size, status
  // requests left unanswered, and the latest job list.
  struct Watch {
    uint64_t max_used = 0, pool_size = 0;
    int unanswered = 0;
    nlohmann::json jobs;
  };
  // Polls status and jobs until `done(jobs)` holds or three minutes pass.
  bool watch(Cluster& c, const std::function<bool(const nlohmann::json&)>& done, Watch& w) {
    auto deadline = std::chrono::steady_clock::now() + 180s;
    while (std::chrono::steady_clock::now() < deadline) {
      auto s = c.status(5s);
      if (!s) {
        ++w.unanswered;
        continue;
      }
      w.max_used = std::max(w.max_used, (*s)["devices"][0]["used_bytes"].get<uint64_t>());
      w.pool_size = (*s)["devices"][0]["size_bytes"];
      w.jobs = jobs(c);
      if (w.jobs.size() == 3 && done(w.jobs)) return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  }
  static bool ended(const nlohmann::json& job) {
    return job["state"] != "queued" && job["state"] != "running";
  }

  // Every epoch's training loss: bit-identical training gives identical
  // losses (the synthetic test set is easy; accuracy alone would not tell).
  static std::vector<double> losses(const nlohmann::json& job) {
    std::vector<double> out;
    for (const auto& e : job["epochs"]) out.push_back(e["train_loss"].get<double>());
    return out;
  }

  Cluster data;  // the dataset's folder
  std::map<std::string, double> alone_accuracy;
  std::map<std::string, std::vector<double>> alone_losses;
  uint64_t peak = 0, peak_mib = 0, pool_mib = 0;
};

TEST_F(Oversubscribed, EveryJobFinishesWithItsAloneAccuracyAndSomeoneShrank) {
  ASSERT_NO_FATAL_FAILURE(run_alone());
  Cluster c;
  ASSERT_NO_FATAL_FAILURE(start_oversubscribed(c, {{"a1", false}, {"a2", false}, {"a3", false}}));
  ASSERT_NO_FATAL_FAILURE(submit_all(c));
  // C waits for memory, and says so.
  ASSERT_TRUE(c.wait_for(
      [&](const auto&) {
        for (const auto& j : jobs(c)) {
          if (j["name"] == "c" &&
              j["waiting_for"].get<std::string>().rfind("waiting for ", 0) == 0) {
            return true;
          }
        }
        return false;
      },
      10s))
      << jobs(c).dump(2);

  Watch w;
  ASSERT_TRUE(watch(
      c, [](const auto& list) { return ended(list[0]) && ended(list[1]) && ended(list[2]); }, w))
      << w.jobs.dump(2);
  EXPECT_EQ(w.unanswered, 0);
  EXPECT_LE(w.max_used, w.pool_size);
  uint32_t shrinks = 0;
  for (const auto& j : w.jobs) {
    std::string name = j["name"];
    EXPECT_EQ(j["state"], "succeeded") << j.dump(2);
    EXPECT_EQ(j["test_accuracy"].get<double>(), alone_accuracy[name])
        << "job " << name << " trained differently beside the others";
    EXPECT_EQ(losses(j), alone_losses[name]) << "job " << name;
    shrinks += j["shrinks"].get<uint32_t>();
    if (name == "c") {
      EXPECT_GT(j["memory_wait_ms"].get<uint64_t>(), 0u) << j.dump(2);
    }
    if (name == "a") {
      EXPECT_GT(j["progress"]["spilled_bytes"].get<uint64_t>(), 0u) << j.dump(2);
    }
  }
  EXPECT_GE(shrinks, 1u) << "B held memory past its share when C needed it";
  auto [rc, text] = client(c, {"job", "2"});
  EXPECT_NE(text.find("shrink(s) released"), std::string::npos) << text;
}

TEST_F(Oversubscribed, AnAgentIgnoringShrinkDoesNotWedgeTheCoordinator) {
  ASSERT_NO_FATAL_FAILURE(run_alone());
  Cluster c;
  // B goes to the agent that never answers, and trains until cancelled.
  ASSERT_NO_FATAL_FAILURE(
      start_oversubscribed(c, {{"a1", false}, {"b-deaf", true}, {"c3", false}}));
  ASSERT_NO_FATAL_FAILURE(submit_all(c, /*b_epochs=*/100000));
  // C needs memory B grew into; B is asked, does not answer, is skipped,
  // then dropped as unresponsive and its job requeued; C gets the memory.
  Watch w;
  ASSERT_TRUE(watch(
      c,
      [](const auto& list) {
        return ended(list[0]) && ended(list[2]) && list[1]["attempts"].template get<int>() >= 2;
      },
      w))
      << w.jobs.dump(2);
  EXPECT_EQ(w.unanswered, 0) << "the coordinator kept answering";
  EXPECT_LE(w.max_used, w.pool_size);
  const nlohmann::json& list = w.jobs;
  for (int i : {0, 2}) {
    EXPECT_EQ(list[i]["state"], "succeeded") << list[i].dump(2);
    std::string name = list[i]["name"];
    EXPECT_EQ(list[i]["test_accuracy"].get<double>(), alone_accuracy[name]);
    EXPECT_EQ(losses(list[i]), alone_losses[name]) << name;
  }
  // B's first attempt ended when its agent was dropped for not answering.
  auto [rc, text] = client(c, {"job", "2"});
  EXPECT_NE(text.find("did not answer a Shrink"), std::string::npos) << text;
  auto [crc, cout_] = client(c, {"cancel", "2"});
  EXPECT_EQ(crc, 0) << cout_;
}

}  // namespace
}  // namespace leasehold::testing
