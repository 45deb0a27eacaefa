// Data-parallel engine jobs as real processes: a job of 2 replicas on 2
// devices (Gloo over the host backend's --host-devices 2; NCCL on 2 GPUs
// under LEASEHOLD_TEST_BACKEND=cuda) reaches the weights one replica
// reaches at the same global batch, and resumes from its checkpoint as one
// gang after a replica's agent is killed.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <fstream>
#include <iterator>
#include <map>

#include "shared/device.h"
#include "shared/safetensors.h"
#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

class DataParallel : public ::testing::Test {
 protected:
  // False (the test skips) where fewer than 2 GPUs are visible.
  bool start() {
    if (cuda && cuda_device_count() < 2) return false;
    // 600 samples: 10 global batches of 60 an epoch, none left over.
    write_synthetic_idx(c.dir(), "train", 600, 1);
    write_synthetic_idx(c.dir(), "test", 150, 2);
    std::vector<std::string> args =
        cuda ? std::vector<std::string>{"--backend", "cuda", "--devices", "0,1"}
             : std::vector<std::string>{"--backend", "host", "--host-devices", "2"};
    args.insert(args.end(), {"--pool-size", cuda ? "512MiB" : "64MiB", "--alignment", "1MiB",
                             "--heartbeat-interval", "200ms"});
    coordinator = &c.start_coordinator(args);
    return true;
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    args.insert(args.begin(), {"--endpoint", c.endpoint()});
    return c.run("leasehold", args);
  }
  uint64_t submit(const std::string& name, const std::string& extra, int hidden = 16) {
    const std::string path = c.dir() + "/" + name + ".json";
    std::ofstream(path) << synthetic_job_json(c.dir(), name, extra, hidden);
    auto [rc, out] = client({"submit", path, "-o", "json"});
    EXPECT_EQ(rc, 0) << out;
    return rc == 0 ? nlohmann::json::parse(out).at("id").get<uint64_t>() : 0;
  }
  bool ends(uint64_t id, const std::string& state, std::chrono::milliseconds timeout) {
    const bool ended = c.wait_job(
        id, [](const auto& j) { return j["state"] != "queued" && j["state"] != "running"; },
        timeout);
    return ended && c.job(id)["state"] == state;
  }
  // The job's final checkpoint: tensor name -> float32 values.
  std::map<std::string, std::vector<float>> weights(uint64_t id) {
    const std::string file = c.dir() + "/job" + std::to_string(id) + ".ckpt";
    auto [rc, out] = client({"checkpoint", std::to_string(id), "-o", file});
    EXPECT_EQ(rc, 0) << out;
    std::ifstream in(file, std::ios::binary);
    bytes_[id] = std::string((std::istreambuf_iterator<char>(in)), {});
    std::map<std::string, std::vector<float>> out_map;
    for (const auto& t : read_checkpoint_tensors(bytes_[id], file)) {
      if (t.dtype != "F32") continue;
      std::vector<float> v(t.data.size() / sizeof(float));
      std::memcpy(v.data(), t.data.data(), v.size() * sizeof(float));
      out_map[t.name] = std::move(v);
    }
    return out_map;
  }

  const bool cuda = test_backend() == "cuda";
  Cluster c;
  Process* coordinator = nullptr;
  std::map<uint64_t, std::string> bytes_;
};

// Averaging the gradients of 2 × 30 samples is the gradient of the 60
// samples of one replica's batch: the weights agree to float rounding (the
// sums are taken in another order), and the replicas' own weights are
// bit-identical (the job checks every epoch).
TEST_F(DataParallel, TwoReplicasReachTheWeightsOfOneAtTheSameGlobalBatch) {
  if (!start()) GTEST_SKIP() << "fewer than 2 GPUs visible";
  c.start_agent("w0", {"--device", "0"});
  c.start_agent("w1", {"--device", "1"});
  const uint64_t one = submit("one", R"(, "epochs": 3, "batch_size": 60)");
  ASSERT_TRUE(ends(one, "succeeded", 120s)) << c.job(one).dump(1) << coordinator->log();
  const uint64_t two = submit("two", R"(, "epochs": 3, "batch_size": 30, "replicas": 2)");
  ASSERT_TRUE(ends(two, "succeeded", 120s)) << c.job(two).dump(1) << coordinator->log();
  const nlohmann::json j = c.job(two);
  ASSERT_EQ(j["attempt_history"].back()["replica_agents"].size(), 1u) << j.dump(1);
  EXPECT_NE(j["attempt_history"].back()["agent"], j["attempt_history"].back()["replica_agents"][0]);
  ASSERT_EQ(j["epochs"].size(), 3u) << j.dump(1);
  auto [trc, text] = client({"job", std::to_string(two)});
  EXPECT_NE(text.find("and 1 more replica"), std::string::npos) << text;

  const auto a = weights(one), b = weights(two);
  size_t compared = 0;
  double worst = 0;
  for (const auto& [name, va] : a) {
    if (name.rfind("job.", 0) == 0) continue;
    auto it = b.find(name);
    ASSERT_NE(it, b.end()) << name;
    ASSERT_EQ(it->second.size(), va.size()) << name;
    for (size_t i = 0; i < va.size(); ++i) {
      worst = std::max(worst, std::abs(double(va[i]) - double(it->second[i])));
    }
    ++compared;
  }
  EXPECT_GE(compared, 4u) << "two weights and two biases at least";
  // Adam over 30 steps turns float rounding of the summation order into
  // differences of about 1e-6; a wrong shard or scale is off by 1e-2.
  EXPECT_LT(worst, 1e-4) << "largest difference between the two runs' weights";
  std::printf("largest difference between the two runs' weights: %.3g\n", worst);
  EXPECT_NEAR(c.job(two)["test_accuracy"].get<double>(), c.job(one)["test_accuracy"].get<double>(),
              0.02);
}

TEST_F(DataParallel, AGangResumesFromItsCheckpointAfterAReplicasAgentIsKilled) {
  if (!start()) GTEST_SKIP() << "fewer than 2 GPUs visible";
  c.start_agent("w0", {"--device", "0"});
  Process& w1 = c.start_agent("w1", {"--device", "1"});
  const uint64_t id = submit("long", R"(, "epochs": 120, "batch_size": 30, "replicas": 2)", 64);
  ASSERT_TRUE(c.wait_job(
      id, [](const auto& j) { return j["epochs"].size() >= 2; }, 120s))
      << c.job(id).dump(1) << coordinator->log();
  w1.signal(SIGKILL);
  // The gang stops as one and waits for a second device's agent.
  ASSERT_TRUE(c.wait_job(
      id, [](const auto& j) { return j["state"] == "queued"; }, 30s))
      << c.job(id).dump(1);
  c.start_agent("w2", {"--device", "1"});
  ASSERT_TRUE(ends(id, "succeeded", 300s)) << c.job(id).dump(1) << coordinator->log();
  const nlohmann::json j = c.job(id);
  ASSERT_GE(j["attempt_history"].size(), 2u) << j.dump(1);
  const auto& first = j["attempt_history"][0];
  EXPECT_EQ(first["cause"], "agent_died") << first.dump();
  const auto& last = j["attempt_history"].back();
  EXPECT_GE(last["resumed_from_epoch"].get<int>(), 2) << j.dump(1);
  EXPECT_EQ(last["replica_agents"][0], "w2");
  EXPECT_EQ(j["epochs"].size(), 120u);
  EXPECT_GT(j["test_accuracy"].get<double>(), 0.9);
}

TEST_F(DataParallel, CancelStopsEveryReplicaMidEpoch) {
  if (!start()) GTEST_SKIP() << "fewer than 2 GPUs visible";
  c.start_agent("w0", {"--device", "0"});
  c.start_agent("w1", {"--device", "1"});
  const uint64_t id = submit("cancelled", R"(, "epochs": 1000, "batch_size": 30, "replicas": 2)", 64);
  ASSERT_TRUE(c.wait_job(
      id, [](const auto& j) { return j["epochs"].size() >= 1; }, 120s))
      << c.job(id).dump(1) << coordinator->log();
  auto [rc, out] = client({"cancel", std::to_string(id)});
  ASSERT_EQ(rc, 0) << out;
  // Both replicas stop (wherever each was: a collective, the rendezvous)
  // and both agents stand by again, with nothing leased.
  ASSERT_TRUE(ends(id, "cancelled", 60s)) << c.job(id).dump(1) << coordinator->log();
  EXPECT_TRUE(c.wait_for(
      [](const auto& s) {
        return idle_agents(s) == 2 && s["devices"][0]["used_bytes"] == 0 &&
               s["devices"][1]["used_bytes"] == 0;
      },
      60s))
      << c.status().value_or(nlohmann::json{}).dump(1);
}

}  // namespace
}  // namespace leasehold::testing
