// The integration scenario on the CUDA backend: one pool of chunks, agent
// processes mapping their own leases' chunks and running kernels in them.
// Skipped (with a message) where no GPU is visible.
#include <gtest/gtest.h>

#include "shared/device.h"
#include "tests/support/cluster.h"
#include "tests/support/isolation.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

class CudaCluster : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_built()) GTEST_SKIP() << "built without CUDA: CUDA integration test skipped";
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: test skipped";
  }
  Cluster cluster;
};

TEST_F(CudaCluster, TwoAgentsShareOneChunkedPool) {
  auto& coordinator = cluster.start_coordinator({"--backend", "cuda", "--devices", "0",
                                                 "--pool-size", "1GiB", "--heartbeat-interval",
                                                 "200ms"});
  auto s = *cluster.status();
  EXPECT_EQ(s["devices"][0]["backend"], "cuda");
  EXPECT_EQ(s["devices"][0]["size_bytes"], 1ull << 30);
  run_isolation_scenario(cluster, 2, "64MiB");
  EXPECT_TRUE(coordinator.running());
}

// A kernel writing outside its agent's leases faults in that agent's own
// context (the address is not mapped there); nobody else's memory changes.
TEST_F(CudaCluster, AStrayKernelWriteFaultsInItsAgentAloneAndNoPatternChanges) {
  cluster.start_coordinator({"--backend", "cuda", "--devices", "0", "--pool-size", "1GiB",
                             "--heartbeat-interval", "200ms", "--mps", "off"});
  run_stray_write_scenario(cluster, "64MiB");
}

// Every GPU's pool under one coordinator: agents without --device spread
// over the GPUs, two per GPU, each writing and checking its pattern in its
// leases; offsets never overlap within a device, and no agent's writes
// reach another's memory on either GPU.
TEST_F(CudaCluster, AgentsOnEveryGpuKeepTheirPatternsIntact) {
  const int gpus = cuda_device_count();
  if (gpus < 2) GTEST_SKIP() << "fewer than 2 GPUs visible";
  auto& coordinator = cluster.start_coordinator(
      {"--backend", "cuda", "--pool-size", "1GiB", "--heartbeat-interval", "200ms"});
  auto s = *cluster.status();
  ASSERT_EQ(s["devices"].size(), size_t(gpus)) << "devices = all by default";
  run_isolation_scenario(cluster, 2 * gpus, "64MiB");
  EXPECT_TRUE(coordinator.running());
}

TEST_F(CudaCluster, KilledCudaAgentIsReclaimed) {
  cluster.start_coordinator(
      {"--backend", "cuda", "--pool-size", "256MiB", "--heartbeat-interval", "200ms"});
  auto& doomed = cluster.start_agent("doomed", {"--exercise", "--leases", "2", "--lease-size",
                                                "16MiB", "--rounds", "0", "--interval", "20ms"});
  ASSERT_TRUE(cluster.wait_for([](const auto& st) { return leased_by(st, "doomed") > 0; }, 20s))
      << doomed.log();
  doomed.signal(SIGKILL);
  auto t0 = std::chrono::steady_clock::now();
  ASSERT_TRUE(cluster.wait_for([](const auto& st) { return st["leases"].empty(); }, 5s));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 600ms);
}

}  // namespace
}  // namespace leasehold::testing
