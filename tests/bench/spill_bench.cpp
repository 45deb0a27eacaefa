// Spill benchmark: trains the same steps of a job (default: the CNN of
// deploy/jobs/fashion-mnist-cnn-spill.json on Fashion-MNIST) unconstrained and with
// memory budgets below its peak, spilling to the host tier only and to the
// spill file only, side by side in one run, inside real leases of a
// coordinator it starts. Per configuration it prints the median step time,
// throughput against the unconstrained run, bytes moved per step, the copy
// and disk bandwidth achieved, the peak device memory (which must stay
// within the budget) and whether the weights equal the unconstrained ones
// bit for bit. Beside them: pinned host↔device copy bandwidth measured the
// same way. Prints JSON.
//
//   leasehold-bench-spill [--job FILE] [--steps 8] [--warmup 2]
//                         [--budgets 0.5,0.25] [--spill-dir DIR]
//                         [--backend auto|host|cuda] [--pool-size 24GiB]
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine/data.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "agent/lease_allocator.h"
#include "agent/model_builder.h"
#include "agent/spill/spill_manager.h"
#include "agent/spill/tiered_store.h"
#include "shared/device.h"
#include "shared/job_spec.h"
#include "shared/log.h"
#include "shared/units.h"
#include "tests/support/cluster.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include "shared/cuda_check.h"
#endif

namespace lh = leasehold;
namespace E = leasehold::engine;
namespace S = leasehold::spill;
using Clock = std::chrono::steady_clock;

namespace {

struct Config {
  std::string name;
  double budget_fraction = 0;  // 0: unconstrained
  bool host_tier = false, file_tier = false;
};

struct Run {
  std::vector<double> step_ms;
  std::vector<float> weights;
  uint64_t peak_leased = 0, budget = 0;
  uint64_t pages_mapped = 0, trims = 0;  // the lease allocator's, warm-up included
  S::SpillStats stats;
  S::SpillCounters counters;
  double seconds = 0;
};

void sync(E::Device d) {
#ifdef LEASEHOLD_HAVE_CUDA
  if (d.is_cuda()) E::synchronize(d.index);
#endif
  (void)d;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

class Bench {
 public:
  Bench(lh::AgentSession& session, const lh::proto::JobSpec& job, E::Device device, int steps,
        int warmup, std::string spill_dir, S::SpillPolicy policy)
      : session_(session), job_(job), device_(device), steps_(steps), warmup_(warmup),
        dir_(std::move(spill_dir)), policy_(policy), transfer_(S::make_transfer(device)) {
    lh::DatasetFiles f = lh::dataset_files(job);
    E::AllocatorGuard host(E::cpu_allocator());
    int64_t limit = static_cast<int64_t>(job.batch_size()) * (steps + warmup);
    train_ = E::data::load_idx_dataset(f.train_images, f.train_labels, job.dataset()->mean(),
                                       job.dataset()->std(), static_cast<int32_t>(limit));
  }

  Run run(uint64_t budget, bool host_tier, bool file_tier, uint64_t host_bytes) {
    auto alloc = std::make_shared<lh::LeaseAllocator>(
        session_, lh::LeaseAllocatorOptions::for_budget(budget));
    Run r;
    r.budget = budget;
    {
      E::AllocatorGuard guard(alloc);
      std::unique_ptr<S::PinnedBuffer> host, staging;  // outlive the store in `manager`
      std::shared_ptr<S::SpillManager> manager;
      if (host_tier || file_tier) {
        S::TieredStoreOptions o;
        if (host_tier) {
          host = std::make_unique<S::PinnedBuffer>(host_bytes, device_);
          o.host_tier = host.get();
        }
        if (file_tier) {
          staging = std::make_unique<S::PinnedBuffer>(64ull << 20, device_);
          o.staging = staging.get();
          o.directory = dir_;
          o.tag = "bench";
        }
        manager = S::SpillManager::create(std::make_unique<S::TieredSpillStore>(*transfer_, o),
                                          transfer_, alloc, policy_);
      }
      E::manual_seed(job_.seed());
      auto model = lh::build_model(*job_.model(), {E::DType::Float32, device_});
      E::optim::Adam opt(model->named_parameters(), {.lr = 0.001});
      E::data::BatchIterator batches(train_, job_.batch_size(), true, job_.seed());
      batches.start_epoch(0);
      std::optional<E::SavedTensorHooksGuard> hooks;
      if (manager) {
        manager->keep_resident(model->parameters());
        hooks.emplace(manager);
      }
      E::Tensor x, y;
      S::SpillStats before;
      auto start = Clock::now();
      for (int i = 0; i < warmup_ + steps_ && batches.next(x, y, device_); ++i) {
        if (i == warmup_) {
          sync(device_);
          if (manager) before = manager->store_stats();
          start = Clock::now();
        }
        auto t0 = Clock::now();
        opt.zero_grad();
        E::cross_entropy((*model)(x), y).backward();
        opt.step();
        if (manager) manager->end_step();  // (as a job's run does after each step)
        sync(device_);
        if (i >= warmup_) {
          r.step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
        }
      }
      r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
      hooks.reset();
      if (manager) {
        S::SpillStats after = manager->store_stats();
        r.stats = after;
        r.stats.bytes_out = after.bytes_out - before.bytes_out;
        r.stats.bytes_in = after.bytes_in - before.bytes_in;
        r.stats.file_bytes_written = after.file_bytes_written - before.file_bytes_written;
        r.stats.file_bytes_read = after.file_bytes_read - before.file_bytes_read;
        r.stats.copy_busy_seconds = after.copy_busy_seconds - before.copy_busy_seconds;
        r.stats.file_busy_seconds = after.file_busy_seconds - before.file_busy_seconds;
        r.counters = manager->counters();
      }
      for (auto& p : model->parameters()) {
        auto w = p.to_vector<float>();
        r.weights.insert(r.weights.end(), w.begin(), w.end());
      }
    }
    r.peak_leased = alloc->stats().peak_leased_bytes;
    r.pages_mapped = alloc->stats().pages_mapped;
    r.trims = alloc->stats().trims;
    return r;
  }

 private:
  lh::AgentSession& session_;
  const lh::proto::JobSpec& job_;
  E::Device device_;
  int steps_, warmup_;
  std::string dir_;
  S::SpillPolicy policy_;
  std::shared_ptr<S::Transfer> transfer_;
  E::data::Dataset train_;
};

// Pinned host ↔ device copy bandwidth, GB/s (1e9 bytes), one copy stream.
nlohmann::json pinned_bandwidth(E::Device device) {
  nlohmann::json out;
#ifdef LEASEHOLD_HAVE_CUDA
  if (!device.is_cuda()) return out;
  const size_t bytes = 512ull << 20;
  S::PinnedBuffer host(bytes, device);
  std::memset(host.data(), 1, bytes);
  void* dev = nullptr;
  LEASEHOLD_CUDA_CHECK(cudaMalloc(&dev, bytes));
  cudaStream_t s;
  LEASEHOLD_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto time = [&](cudaMemcpyKind kind) {
    double best = 1e30;
    for (int i = 0; i < 5; ++i) {
      auto t0 = Clock::now();
      if (kind == cudaMemcpyHostToDevice) {
        LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(dev, host.data(), bytes, kind, s));
      } else {
        LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(host.data(), dev, bytes, kind, s));
      }
      LEASEHOLD_CUDA_CHECK(cudaStreamSynchronize(s));
      best = std::min(best, std::chrono::duration<double>(Clock::now() - t0).count());
    }
    return bytes / best / 1e9;
  };
  out["host_to_device_gbps"] = time(cudaMemcpyHostToDevice);
  out["device_to_host_gbps"] = time(cudaMemcpyDeviceToHost);
  LEASEHOLD_CUDA_CHECK(cudaStreamDestroy(s));
  LEASEHOLD_CUDA_CHECK(cudaFree(dev));
#else
  (void)device;
#endif
  return out;
}

std::vector<double> parse_fractions(const std::string& text) {
  std::vector<double> out;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) out.push_back(std::stod(item));
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold spill benchmark"};
  std::string job_file = "deploy/jobs/fashion-mnist-cnn-spill.json", budgets = "0.5,0.25",
              spill_dir = std::filesystem::temp_directory_path().string(), backend = "auto",
              pool_size = "24GiB";
  int steps = 8, warmup = 2;
  S::SpillPolicy policy;
  std::string tiers = "host,file";
  app.add_option("--job", job_file, "job file whose model, data and batch size are used")
      ->capture_default_str();
  app.add_option("--steps", steps, "timed steps per configuration")->capture_default_str();
  app.add_option("--warmup", warmup, "untimed steps first")->capture_default_str();
  app.add_option("--budgets", budgets, "budgets as fractions of the unconstrained peak")
      ->capture_default_str();
  app.add_option("--spill-dir", spill_dir, "directory of the spill file")->capture_default_str();
  app.add_option("--backend", backend, "auto|host|cuda")->capture_default_str();
  app.add_option("--tiers", tiers, "host, file or both")->capture_default_str();
  app.add_option("--lookahead", policy.lookahead, "spill policy: entries restored ahead")
      ->capture_default_str();
  app.add_option("--headroom", policy.prefetch_headroom, "spill policy: prefetch headroom")
      ->capture_default_str();
  app.add_option("--offload-mark", policy.offload_mark,
                 "spill policy: copy ahead above this fraction of the budget")
      ->capture_default_str();
  app.add_option("--pool-size", pool_size, "coordinator pool size")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  lh::init_logging("warn", "bench");
  try {
    std::ifstream in(job_file);
    if (!in) throw std::runtime_error("cannot read " + job_file);
    std::stringstream text;
    text << in.rdbuf();
    auto buffer = lh::parse_job_json(text.str(), job_file);
    const lh::proto::JobSpec& job = *lh::verify_job(buffer);
    if (backend == "auto") backend = lh::cuda_device_count() > 0 ? "cuda" : "host";
    lh::testing::Cluster cluster;
    cluster.start_coordinator(
        {"--backend", backend, "--pool-size", pool_size, "--heartbeat-interval", "500ms"});
    lh::AgentOptions ao;
    ao.endpoint = cluster.endpoint();
    ao.name = "spill-bench";
    lh::AgentSession session(ao);
    E::Device device = session.pool().backend == lh::Backend::Cuda
                           ? E::Device::cuda(session.pool().device)
                           : E::Device::cpu();
    Bench bench(session, job, device, steps, warmup, spill_dir, policy);

    nlohmann::json out;
    out["job"] = job_file;
    out["device"] = session.pool().device_name;
    out["batch_size"] = job.batch_size();
    out["steps"] = steps;
    out["spill_dir"] = spill_dir;
    out["lookahead"] = policy.lookahead;
    out["prefetch_headroom"] = policy.prefetch_headroom;
    out["offload_mark"] = policy.offload_mark;
    out["pinned_copy"] = pinned_bandwidth(device);

    Run base = bench.run(0, false, false, 0);
    double base_ms = median(base.step_ms);
    out["unconstrained"] = {{"step_ms", base_ms},
                            {"samples_per_second", job.batch_size() * 1000.0 / base_ms},
                            {"peak_device_bytes", base.peak_leased}};
    std::fprintf(stderr, "unconstrained: %.1f ms/step, peak %s\n", base_ms,
                 lh::format_bytes(base.peak_leased).c_str());
    out["runs"] = nlohmann::json::array();
    for (double fraction : parse_fractions(budgets)) {
      uint64_t budget = lh::align_up(static_cast<uint64_t>(base.peak_leased * fraction), 2ull << 20);
      for (int tier = 0; tier < 2; ++tier) {
        bool host = tier == 0;
        if (tiers.find(host ? "host" : "file") == std::string::npos) continue;
        Run r = bench.run(budget, host, !host, host ? base.peak_leased : 0);
        double ms = median(r.step_ms);
        double moved = double(r.stats.bytes_out + r.stats.bytes_in) / steps;
        double copy_gbps = r.stats.copy_busy_seconds > 0
                               ? (r.stats.bytes_out + r.stats.bytes_in) / r.stats.copy_busy_seconds / 1e9
                               : 0;
        double file_bytes = double(r.stats.file_bytes_written + r.stats.file_bytes_read);
        double disk_gbps =
            r.stats.file_busy_seconds > 0 ? file_bytes / r.stats.file_busy_seconds / 1e9 : 0;
        nlohmann::json j{{"budget_fraction", fraction},
                         {"budget_bytes", budget},
                         {"tier", host ? "host" : "file"},
                         {"step_ms", ms},
                         {"throughput_vs_unconstrained", base_ms / ms},
                         {"bytes_moved_per_step", moved},
                         {"copy_gbps", copy_gbps},
                         {"disk_gbps", disk_gbps},
                         {"file_bytes_per_step", file_bytes / steps},
                         {"staging_hits", r.stats.staging_hits},
                         {"evictions", r.counters.evictions},
                         {"restores", r.counters.restores},
                         {"prefetched", r.counters.prefetched},
                         {"peak_device_bytes", r.peak_leased},
                         {"pages_mapped", r.pages_mapped},
                         {"trims", r.trims},
                         {"within_budget", r.peak_leased <= budget},
                         {"weights_identical", r.weights == base.weights}};
        std::fprintf(stderr, "%s\n", j.dump().c_str());
        out["runs"].push_back(j);
      }
    }
    std::printf("%s\n", out.dump(2).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-bench-spill: %s\n", e.what());
    return 1;
  }
  return 0;
}
