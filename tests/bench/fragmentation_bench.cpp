// Fragmentation benchmark: how full a pool gets before a request is refused
// for lack of a place, not of memory. Several jobs (each its own agent
// session and lease allocator, no budget) allocate and free tensors of
// mixed sizes (log-uniform between --min and --max) at random, mostly
// allocating, until one request cannot be served even after every job gave
// its cached memory back (empty_cache). The figure is the pool's occupancy
// then: the live bytes of all jobs over the pool's size. A job's memory
// made of pages (any free chunk serves any tensor) should reach close to
// the whole pool; memory made of contiguous leases stops where no free run
// is long enough. The source builds against the lease allocator's
// interface only, so the same program measures an older allocator too.
// Prints JSON.
//
//   leasehold-bench-fragmentation [--backend auto|host|cuda] [--pool-size 1GiB]
//                                 [--jobs 4] [--seeds 5] [--min 4KiB] [--max 96MiB]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <random>
#include <vector>

#include "agent/lease_allocator.h"
#include "shared/log.h"
#include "shared/units.h"
#include "tests/support/cluster.h"

namespace lh = leasehold;
namespace E = leasehold::engine;

namespace {

struct Options {
  std::string backend = "auto";
  std::string pool_size = "1GiB";
  int jobs = 4;
  int seeds = 5;
  std::string min = "4KiB";
  std::string max = "96MiB";
};

nlohmann::json run(const Options& o, unsigned seed) {
  lh::testing::Cluster cluster;
  cluster.start_coordinator({"--backend", o.backend, "--pool-size", o.pool_size,
                             "--heartbeat-interval", "500ms"});
  std::vector<std::unique_ptr<lh::AgentSession>> sessions;
  std::vector<std::unique_ptr<lh::LeaseAllocator>> allocators;
  for (int j = 0; j < o.jobs; ++j) {
    lh::AgentOptions ao;
    ao.endpoint = cluster.endpoint();
    ao.name = "job" + std::to_string(j);
    sessions.push_back(std::make_unique<lh::AgentSession>(ao));
    allocators.push_back(std::make_unique<lh::LeaseAllocator>(*sessions.back()));
  }
  const uint64_t pool = sessions[0]->pool().size;
  const double lo = std::log(double(lh::parse_bytes(o.min)));
  const double hi = std::log(double(lh::parse_bytes(o.max)));
  std::mt19937_64 gen(seed);
  std::uniform_real_distribution<double> size_dist(lo, hi);
  struct Tensor {
    void* p;
    uint64_t size;
  };
  std::vector<std::vector<Tensor>> live(o.jobs);
  uint64_t live_bytes = 0, allocations = 0;
  nlohmann::json out{{"seed", seed}};
  for (uint64_t round = 0; round < 1000000; ++round) {
    const int j = static_cast<int>(gen() % o.jobs);
    if (!live[j].empty() && gen() % 4 == 0) {
      const size_t k = gen() % live[j].size();
      allocators[j]->deallocate(live[j][k].p, live[j][k].size);
      live_bytes -= live[j][k].size;
      live[j][k] = live[j].back();
      live[j].pop_back();
      continue;
    }
    const uint64_t size = lh::align_up(static_cast<uint64_t>(std::exp(size_dist(gen))), 512);
    void* p = nullptr;
    for (int attempt = 0; attempt < 2 && !p; ++attempt) {
      try {
        p = allocators[j]->allocate(size);
      } catch (const E::OutOfMemoryError& e) {
        if (attempt == 1) {
          out["occupancy"] = double(live_bytes) / double(pool);
          out["live_bytes"] = live_bytes;
          out["request_bytes"] = size;
          out["allocations"] = allocations;
          out["refusal"] = e.what();
          return out;
        }
        // Every job gives back what it caches: what is left is live.
        for (auto& a : allocators) a->empty_cache();
      }
    }
    live[j].push_back({p, size});
    live_bytes += size;
    ++allocations;
  }
  out["occupancy"] = double(live_bytes) / double(pool);
  out["refusal"] = "none within a million rounds";
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold-bench-fragmentation: pool occupancy reached before a refusal"};
  Options o;
  app.add_option("--backend", o.backend, "auto|host|cuda")->capture_default_str();
  app.add_option("--pool-size", o.pool_size, "the coordinator's pool")->capture_default_str();
  app.add_option("--jobs", o.jobs, "jobs sharing the pool")->capture_default_str();
  app.add_option("--seeds", o.seeds, "runs, each with its own seed")->capture_default_str();
  app.add_option("--min", o.min, "smallest tensor")->capture_default_str();
  app.add_option("--max", o.max, "largest tensor")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  lh::init_logging("warn", "bench");
  try {
    nlohmann::json runs = nlohmann::json::array();
    std::vector<double> occupancy;
    for (int s = 1; s <= o.seeds; ++s) {
      runs.push_back(run(o, static_cast<unsigned>(s)));
      occupancy.push_back(runs.back()["occupancy"].get<double>());
      std::fprintf(stderr, "%s\n", runs.back().dump().c_str());
    }
    std::sort(occupancy.begin(), occupancy.end());
    nlohmann::json out{{"pool_size", o.pool_size},
                       {"jobs", o.jobs},
                       {"tensor_sizes", o.min + " to " + o.max + ", log-uniform"},
                       {"occupancy_min", occupancy.front()},
                       {"occupancy_median", occupancy[occupancy.size() / 2]},
                       {"occupancy_max", occupancy.back()},
                       {"runs", runs}};
    std::printf("%s\n", out.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-bench-fragmentation: %s\n", e.what());
    return 1;
  }
  return 0;
}
