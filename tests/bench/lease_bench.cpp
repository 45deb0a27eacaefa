// Lease grant benchmark: round-trip latency of a lease (request sent → grant
// received → memory pointer usable) and grants per second with 1, 8 and 32
// concurrent agent processes, beside the allocator a process would otherwise
// call itself (cudaMalloc/cudaFree on cuda, malloc/free on host) for the same
// sizes. Prints JSON.
//
//   leasehold-bench-lease [--backend auto|host|cuda] [--agents 1,8,32]
//                         [--iterations 2000] [--sizes 2MiB,16MiB,64MiB]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>
#include <thread>
#include <vector>

#include "lease_client/session.h"
#include "shared/device.h"
#include "shared/log.h"
#include "shared/units.h"
#include "tests/support/cluster.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include "shared/cuda_check.h"
#endif

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

std::vector<uint64_t> parse_sizes(const std::string& text) {
  std::vector<uint64_t> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(lh::parse_bytes(item));
  return out;
}

// One agent process: registers, warms up, waits for the start signal, then
// times `iterations` acquire/release cycles and writes its samples.
int worker(const std::string& endpoint, const std::string& name, int iterations,
           const std::vector<uint64_t>& sizes, const std::string& dir) {
  lh::AgentOptions o;
  o.endpoint = endpoint;
  o.name = name;
  lh::AgentSession s(o);
  for (int i = 0; i < 20; ++i) {
    auto l = s.acquire(sizes[i % sizes.size()]);
    s.release(l);
  }
  std::ofstream(dir + "/" + name + ".ready") << "ready";
  while (!std::filesystem::exists(dir + "/go"))
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  std::vector<double> grant, cycle;
  grant.reserve(iterations);
  cycle.reserve(iterations);
  volatile std::byte* sink = nullptr;
  auto start = Clock::now();
  for (int i = 0; i < iterations; ++i) {
    auto t0 = Clock::now();
    auto l = s.acquire(sizes[i % sizes.size()], lh::LeaseEnd::Low, std::chrono::milliseconds(0));
    sink = l.data();  // the pointer is usable: the pool is mapped once
    auto t1 = Clock::now();
    s.release(l);
    auto t2 = Clock::now();
    grant.push_back(us(t1 - t0));
    cycle.push_back(us(t2 - t0));
  }
  auto end = Clock::now();
  (void)sink;
  nlohmann::json j{{"grant_us", grant},
                   {"cycle_us", cycle},
                   {"start_ns", start.time_since_epoch().count()},
                   {"end_ns", end.time_since_epoch().count()}};
  std::ofstream(dir + "/" + name + ".json") << j.dump();
  return 0;
}

nlohmann::json summarize(const std::vector<double>& grant, const std::vector<double>& cycle,
                         double seconds, size_t ops) {
  return {{"grant_p50_us", percentile(grant, 50)},
          {"grant_p99_us", percentile(grant, 99)},
          {"cycle_p50_us", percentile(cycle, 50)},
          {"cycle_p99_us", percentile(cycle, 99)},
          {"grants_per_second", ops / seconds}};
}

nlohmann::json run_concurrent(lh::testing::Cluster& cluster, const std::string& self, int agents,
                              int iterations, const std::string& sizes_text) {
  std::string dir = cluster.dir() + "/run-" + std::to_string(agents);
  std::filesystem::create_directories(dir);
  std::vector<std::unique_ptr<lh::testing::Process>> procs;
  for (int i = 0; i < agents; ++i) {
    std::string name = "bench-" + std::to_string(agents) + "-" + std::to_string(i);
    procs.push_back(std::make_unique<lh::testing::Process>(
        std::vector<std::string>{self, "--worker", "--endpoint", cluster.endpoint(), "--name", name,
                                 "--iterations", std::to_string(iterations), "--sizes", sizes_text,
                                 "--dir", dir},
        dir + "/" + name + ".log"));
  }
  auto ready = [&] {
    int n = 0;
    for (auto& e : std::filesystem::directory_iterator(dir)) n += e.path().extension() == ".ready";
    return n;
  };
  auto deadline = Clock::now() + std::chrono::seconds(60);
  while (ready() < agents) {
    for (auto& p : procs) {
      if (!p->running()) throw std::runtime_error("bench worker failed:\n" + p->log());
    }
    if (Clock::now() > deadline) throw std::runtime_error("bench workers did not start");
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  std::ofstream(dir + "/go") << "go";
  std::vector<double> grant, cycle;
  int64_t first = INT64_MAX, last = 0;
  for (int i = 0; i < agents; ++i) {
    auto& p = procs[i];
    auto rc = p->wait(std::chrono::seconds(300));
    if (!rc || *rc != 0) throw std::runtime_error("bench worker failed:\n" + p->log());
    std::ifstream in(dir + "/bench-" + std::to_string(agents) + "-" + std::to_string(i) + ".json");
    auto j = nlohmann::json::parse(in);
    for (double v : j["grant_us"]) grant.push_back(v);
    for (double v : j["cycle_us"]) cycle.push_back(v);
    first = std::min<int64_t>(first, j["start_ns"]);
    last = std::max<int64_t>(last, j["end_ns"]);
  }
  double seconds = std::chrono::duration<double>(Clock::duration(last - first)).count();
  auto out = summarize(grant, cycle, seconds, grant.size());
  out["agents"] = agents;
  return out;
}

// The allocator a process would call without Leasehold, same sizes, one thread.
nlohmann::json baseline(lh::Backend backend, int device, int iterations,
                        const std::vector<uint64_t>& sizes) {
  std::vector<double> alloc, cycle;
  auto start = Clock::now();
  for (int i = -20; i < iterations; ++i) {
    uint64_t size = sizes[(i + 20) % sizes.size()];
    void* p = nullptr;
    auto t0 = Clock::now();
    if (backend == lh::Backend::Cuda) {
#ifdef LEASEHOLD_HAVE_CUDA
      LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
      LEASEHOLD_CUDA_CHECK(cudaMalloc(&p, size));
#endif
    } else {
      p = std::malloc(size);
      if (!p) throw std::bad_alloc();
    }
    auto t1 = Clock::now();
    if (backend == lh::Backend::Cuda) {
#ifdef LEASEHOLD_HAVE_CUDA
      LEASEHOLD_CUDA_CHECK(cudaFree(p));
#endif
    } else {
      std::free(p);
    }
    auto t2 = Clock::now();
    if (i >= 0) {
      alloc.push_back(us(t1 - t0));
      cycle.push_back(us(t2 - t0));
    } else {
      start = Clock::now();
    }
  }
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  auto out = summarize(alloc, cycle, seconds, alloc.size());
  out["allocator"] = backend == lh::Backend::Cuda ? "cudaMalloc+cudaFree" : "malloc+free";
  (void)device;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold lease grant benchmark"};
  bool is_worker = false;
  std::string endpoint, name, dir, backend_text = "auto", agents_text = "1,8,32",
                                   sizes_text = "2MiB,16MiB,64MiB";
  int iterations = 2000;
  app.add_flag("--worker", is_worker)->group("");
  app.add_option("--endpoint", endpoint)->group("");
  app.add_option("--name", name)->group("");
  app.add_option("--dir", dir)->group("");
  app.add_option("--backend", backend_text, "auto|host|cuda")->capture_default_str();
  app.add_option("--agents", agents_text, "concurrent agent counts")->capture_default_str();
  app.add_option("--iterations", iterations, "lease cycles per agent")->capture_default_str();
  app.add_option("--sizes", sizes_text, "lease sizes, cycled")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  lh::init_logging("warn", is_worker ? "bench-worker" : "bench");
  auto sizes = parse_sizes(sizes_text);
  if (is_worker) {
    try {
      return worker(endpoint, name, iterations, sizes, dir);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "bench worker %s: %s\n", name.c_str(), e.what());
      return 1;
    }
  }

  try {
    lh::Backend backend = lh::resolve_backend(backend_text);
    std::vector<int> agent_counts;
    std::stringstream ss(agents_text);
    for (std::string item; std::getline(ss, item, ',');) agent_counts.push_back(std::stoi(item));
    int max_agents = *std::max_element(agent_counts.begin(), agent_counts.end());
    uint64_t max_size = *std::max_element(sizes.begin(), sizes.end());
    // Room for every agent's largest lease at once, so no request waits.
    uint64_t pool = lh::align_up(max_size * max_agents + (64ull << 20), 2ull << 20);

    lh::testing::Cluster cluster;
    auto self = std::filesystem::canonical("/proc/self/exe").string();
    setenv("LEASEHOLD_BIN_DIR", std::filesystem::path(self).parent_path().c_str(), 0);
    cluster.start_coordinator({"--backend", lh::backend_name(backend), "--pool-size",
                               std::to_string(pool), "--log-level", "warn"});
    auto status = *cluster.status();
    nlohmann::json out;
    out["backend"] = lh::backend_name(backend);
    out["device"] = status["devices"][0]["device_name"];
    out["pool_bytes"] = pool;
    out["sizes"] = sizes_text;
    out["iterations_per_agent"] = iterations;
    out["baseline"] = baseline(backend, 0, iterations, sizes);
    out["leasehold"] = nlohmann::json::array();
    for (int n : agent_counts) {
      out["leasehold"].push_back(run_concurrent(cluster, self, n, iterations, sizes_text));
    }
    std::printf("%s\n", out.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-bench-lease: %s\n", e.what());
    return 1;
  }
  return 0;
}
