// One coordinator serving several devices, as real processes: the host
// backend's --host-devices N (a shared-memory segment per device) runs the
// same code paths as N GPUs; LEASEHOLD_TEST_BACKEND=cuda runs them on the
// GPUs (skipped where fewer are visible). Agents bind to a device, jobs
// spread over the devices or go where they are pinned, status shows every
// device, and a configuration naming sizes for devices that are not there
// is refused.
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "shared/device.h"
#include "shared/units.h"
#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

class Devices : public ::testing::Test {
 protected:
  // The flags serving `n` devices of the test backend.
  std::vector<std::string> device_flags(int n) {
    if (!cuda) return {"--backend", "host", "--host-devices", std::to_string(n)};
    std::string list;
    for (int i = 0; i < n; ++i) list += (i ? "," : "") + std::to_string(i);
    return {"--backend", "cuda", "--devices", list};
  }
  // False (the test skips) when the backend has fewer than `n` devices.
  bool start(int n, const std::string& pool_size) {
    if (cuda && cuda_device_count() < n) return false;
    write_synthetic_idx(c.dir(), "train", 600, 1);
    write_synthetic_idx(c.dir(), "test", 150, 2);
    std::vector<std::string> args = device_flags(n);
    args.insert(args.end(),
                {"--pool-size", pool_size, "--alignment", "1MiB", "--heartbeat-interval", "200ms"});
    coordinator = &c.start_coordinator(args);
    return true;
  }
  // A job's `device` pinning device `n` of the test backend.
  std::string pin(int n) const { return (cuda ? "cuda:" : "cpu:") + std::to_string(n); }
  std::string job_file(const std::string& name, const std::string& extra) {
    std::string path = c.dir() + "/" + name + ".json";
    std::ofstream(path) << synthetic_job_json(c.dir(), name, extra);
    return path;
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    args.insert(args.begin(), {"--endpoint", c.endpoint()});
    return c.run("leasehold", args);
  }
  uint64_t submit(const std::string& name, const std::string& extra) {
    auto [rc, out] = client({"submit", job_file(name, extra), "-o", "json"});
    EXPECT_EQ(rc, 0) << out;
    return rc == 0 ? nlohmann::json::parse(out).at("id").get<uint64_t>() : 0;
  }
  // The agent of job `id` once it runs (or ran), else "".
  std::string agent_of(uint64_t id) {
    nlohmann::json j = c.job(id);
    return j.is_object() && j.contains("agent") ? j["agent"].get<std::string>() : "";
  }
  // The device agent `name` is bound to, as status says (-1: not registered).
  int device_of(const std::string& name) {
    auto s = c.status();
    if (!s) return -1;
    for (const auto& a : (*s)["agents"]) {
      if (a["name"] == name) return a["device"].get<int>();
    }
    return -1;
  }

  const bool cuda = test_backend() == "cuda";
  // A job of the synthetic MLP fits these on either backend (the CUDA
  // engine's context and cuBLAS workspace live outside the pool).
  const std::string pool = cuda ? "512MiB" : "64MiB";
  Cluster c;
  Process* coordinator = nullptr;
};

TEST_F(Devices, AgentsBindToDevicesAndJobsGoWhereTheyAreIdleOrPinned) {
  if (!start(2, pool)) GTEST_SKIP() << "fewer than 2 GPUs visible";
  auto s = c.status();
  ASSERT_TRUE(s) << coordinator->log();
  ASSERT_EQ((*s)["devices"].size(), 2u) << s->dump();
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ((*s)["devices"][i]["device"], i);
    if (!cuda) {
      EXPECT_EQ((*s)["devices"][i]["uuid"], "host-" + std::to_string(i));
    }
    EXPECT_EQ((*s)["devices"][i]["size_bytes"], parse_bytes(pool));
  }
  c.start_agent("w0", {"--device", "0"});
  c.start_agent("w1", {"--device", "1"});
  ASSERT_TRUE(c.wait_for([](const auto& s) { return s["agents"].size() == 2; }, 20s));
  EXPECT_EQ(device_of("w0"), 0);
  EXPECT_EQ(device_of("w1"), 1);

  // A long job pinned to device 1 runs on w1; the next one, for any
  // device, goes to w0, the only idle worker.
  const uint64_t pinned = submit("pinned", R"(, "epochs": 400, "device": ")" + pin(1) + "\"");
  ASSERT_TRUE(c.wait_job(
      pinned, [](const auto& j) { return j["state"] == "running"; }, 20s))
      << coordinator->log();
  EXPECT_EQ(agent_of(pinned), "w1");
  const uint64_t any = submit("any", R"(, "epochs": 2)");
  ASSERT_TRUE(c.wait_job(
      any, [](const auto& j) { return j["state"] == "succeeded"; }, 60s))
      << coordinator->log();
  EXPECT_EQ(agent_of(any), "w0");
  // Each job's memory was its own device's: device 0 is empty again while
  // device 1 still holds the pinned job's leases.
  ASSERT_TRUE(c.wait_for(
      [](const auto& s) {
        return s["devices"][0]["used_bytes"] == 0 && s["devices"][1]["used_bytes"] > 0;
      },
      10s))
      << c.status().value_or(nlohmann::json{}).dump();
  const auto after = c.status();
  ASSERT_TRUE(after);
  for (const auto& l : (*after)["leases"]) EXPECT_EQ(l["device"], 1) << l.dump();

  // The table names every device.
  auto [rc, table] = client({"status"});
  ASSERT_EQ(rc, 0) << table;
  const std::string backend = cuda ? "cuda" : "host";
  EXPECT_NE(table.find("Device 0  " + backend), std::string::npos) << table;
  EXPECT_NE(table.find("Device 1  " + backend), std::string::npos) << table;
  ASSERT_EQ(client({"cancel", std::to_string(pinned)}).first, 0);
  EXPECT_TRUE(c.wait_job(
      pinned, [](const auto& j) { return j["state"] == "cancelled"; }, 30s));
}

TEST_F(Devices, AgentsWithoutADeviceSpreadAndPerDeviceSizesApply) {
  // Three devices (two where only two GPUs are visible), each smaller than
  // the one before.
  const int n = cuda ? std::min(3, cuda_device_count()) : 3;
  if (n < 2) GTEST_SKIP() << "fewer than 2 GPUs visible";
  const uint64_t unit = cuda ? 256ull << 20 : 16ull << 20;
  std::string sizes;
  for (int i = 0; i < n; ++i) sizes += (i ? "," : "") + std::to_string((n + 1 - i) * unit);
  ASSERT_TRUE(start(n, sizes));
  auto s = c.status();
  ASSERT_TRUE(s) << coordinator->log();
  ASSERT_EQ((*s)["devices"].size(), size_t(n));
  for (int i = 0; i < n; ++i) EXPECT_EQ((*s)["devices"][i]["size_bytes"], (n + 1 - i) * unit);
  // One at a time, so that each sees the others registered.
  const std::vector<std::string> names{"a", "b", "c"};
  for (int i = 0; i < n; ++i) {
    const std::string& name = names[i];
    c.start_agent(name, {});
    ASSERT_TRUE(c.wait_for(
        [&](const auto& st) {
          for (const auto& a : st["agents"]) {
            if (a["name"] == name) return true;
          }
          return false;
        },
        20s));
  }
  std::set<int> devices, all;
  for (int i = 0; i < n; ++i) {
    devices.insert(device_of(names[i]));
    all.insert(i);
  }
  EXPECT_EQ(devices, all) << "one agent per device";
  // A job pinned to the last device runs on its agent, inside its smallest pool.
  const uint64_t id = submit("last", R"(, "epochs": 1, "device": ")" + pin(n - 1) + "\"");
  ASSERT_TRUE(c.wait_job(
      id, [](const auto& j) { return j["state"] == "succeeded"; }, 60s))
      << coordinator->log();
  EXPECT_EQ(device_of(agent_of(id)), n - 1);
}

TEST_F(Devices, SizesForDevicesThatAreNotThereAreRefused) {
  if (cuda && cuda_device_count() < 2) GTEST_SKIP() << "fewer than 2 GPUs visible";
  std::string why;
  try {
    std::vector<std::string> args = device_flags(2);
    args.insert(args.end(), {"--pool-size", "16MiB,16MiB,16MiB", "--alignment", "1MiB"});
    c.start_coordinator(args);
  } catch (const std::runtime_error& e) {
    why = e.what();  // "coordinator exited at start:" and its log
  }
  EXPECT_NE(why.find("lists 3 sizes for"), std::string::npos) << why;
  EXPECT_NE(why.find("2 devices"), std::string::npos) << why;
}

// An unmodified DDP script (torch.distributed's env:// rendezvous, gloo on
// the host backend, NCCL on GPUs) as a program job of 2 replicas: one
// process per replica, each on its own device with torchrun's variables,
// their weights identical after training; rank 0's reports are the job's.
TEST_F(Devices, ADataParallelPyTorchProgramRunsAReplicaPerDevice) {
  const char* env_python = std::getenv("LEASEHOLD_TEST_PYTHON");
  const std::string python = env_python ? env_python : "/usr/bin/python3";
  if (std::system((python + " -c 'import torch.distributed' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << python << " has no torch.distributed";
  }
  if (!start(2, cuda ? "2GiB" : pool)) GTEST_SKIP() << "fewer than 2 GPUs visible";
  c.start_agent("w0", {"--device", "0"});
  c.start_agent("w1", {"--device", "1"});
  const std::string script = c.dir() + "/ddp.py";
  std::ofstream(script) << R"(
import os, torch, torch.distributed as dist, leasehold
cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and world == 2 and os.environ["LOCAL_RANK"] == "0"
device = torch.device("cuda:0" if cuda else "cpu")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2)).to(device)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.2)
g = torch.Generator().manual_seed(1)
x = torch.randn(512, 8, generator=g)
y = (x.sum(dim=1) > 0).long()
shard_x, shard_y = x[rank::world].to(device), y[rank::world].to(device)
for step in range(1, 61):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ddp(shard_x), shard_y)
    loss.backward()
    opt.step()
w = torch.cat([p.detach().flatten() for p in model.parameters()])
every = [torch.zeros_like(w) for _ in range(world)]
dist.all_gather(every, w)
assert all(torch.equal(every[0], other) for other in every), "replicas diverged"
acc = (model(x.to(device)).argmax(dim=1) == y.to(device)).float().mean().item()
if rank == 0:
    leasehold.report(epoch=1, loss=loss.item(), test_accuracy=acc)
print("rank", rank, "of", world, "weights equal, accuracy", acc, flush=True)
dist.destroy_process_group()
)";
  nlohmann::json spec{{"name", "ddp"},
                      {"replicas", 2},
                      {"memory_budget", cuda ? "1GiB" : "16MiB"},
                      {"program", {{"command", {python, script}}, {"directory", c.dir()}}}};
  const std::string file = c.dir() + "/ddp.json";
  std::ofstream(file) << spec.dump();
  auto [rc, out] = client({"submit", file, "-o", "json"});
  ASSERT_EQ(rc, 0) << out;
  const uint64_t id = nlohmann::json::parse(out).at("id").get<uint64_t>();
  ASSERT_TRUE(c.wait_job(
      id, [](const auto& j) { return j["state"] != "queued" && j["state"] != "running"; }, 120s))
      << coordinator->log();
  const nlohmann::json j = c.job(id);
  ASSERT_EQ(j["state"], "succeeded") << j.dump(1) << client({"logs", std::to_string(id)}).second;
  const auto& attempt = j["attempt_history"].back();
  EXPECT_EQ(attempt["agent"], "w0");
  ASSERT_EQ(attempt["replica_agents"].size(), 1u) << j.dump(1);
  EXPECT_EQ(attempt["replica_agents"][0], "w1");
  ASSERT_EQ(j["epochs"].size(), 1u) << j.dump(1);
  EXPECT_GT(j["epochs"][0]["test_accuracy"].get<double>(), 0.9) << j.dump(1);
  auto [lrc, log] = client({"logs", std::to_string(id)});
  EXPECT_NE(log.find("rank 0 of 2 weights equal"), std::string::npos) << log;
}

}  // namespace
}  // namespace leasehold::testing
