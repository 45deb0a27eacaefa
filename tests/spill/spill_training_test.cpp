// Training past the memory budget: a conv net trained inside a lease
// allocator whose budget is well below its peak, with saved tensors spilled
// through each kind of store, ends with the same weights and gradients, bit
// for bit, as the unconstrained run; a failing store fails the run with a
// clear error, corrupts nothing, and gives every lease back.
//
// Host backend by default; LEASEHOLD_TEST_BACKEND=cuda runs the same tests
// on the GPU (skipped where there is none).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "agent/graphed_steps.h"
#include "agent/lease_allocator.h"
#include "agent/recompute_policy.h"
#include "agent/spill/fault_store.h"
#include "agent/spill/memory_store.h"
#include "agent/spill/spill_manager.h"
#include "agent/spill/tiered_store.h"
#include "shared/device.h"
#include "shared/units.h"
#include "tests/support/cluster.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

namespace leasehold::testing {
namespace {

namespace E = engine;
namespace S = spill;

bool want_cuda() {
  const char* b = std::getenv("LEASEHOLD_TEST_BACKEND");
  return b && std::string(b) == "cuda";
}

bool have_gpu() {
#ifdef LEASEHOLD_HAVE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

struct Outcome {
  std::vector<float> weights, grads;
  uint64_t peak_leased = 0;
  uint64_t peak_in_use = 0;
  S::SpillCounters counters;
  S::SpillStats stats;
};

struct GptRun {
  std::vector<float> weights;
  std::vector<uint64_t> evictions, copied_out;  // after each step
  int mlps = 0, whole = 0, halves = 0;
  uint64_t peak_in_use = 0;
  int64_t graph_steps = 0, graph_steps_before_half = 0, releases = 0;
  int graphs_that_did_not_fit = 0;  // policy steps taken for them after a step op by op
  int need_less_steps = 0;        // policy steps taken at once for a graph's arena (traced again)
  int need_less_after_graph = 0;  // of those, the ones once a graph had run
  int retries = 0;                  // steps run again after running out of memory
  bool mlps_sliced = false;         // the policy's MLPs in slices (not the same bits)
};

// The relative L2 distance between two runs' weights.
double weight_distance(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    diff += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    norm += double(b[i]) * b[i];
  }
  return a.size() == b.size() ? std::sqrt(diff / std::max(norm, 1e-30)) : 1.0;
}

class SpillTraining : public ::testing::Test {
 protected:
  void SetUp() override {
    if (want_cuda() && !have_gpu()) GTEST_SKIP() << "LEASEHOLD_TEST_BACKEND=cuda but no GPU";
    cluster.start_coordinator({"--backend", want_cuda() ? "cuda" : "host", "--pool-size",
                               "256MiB", "--alignment", "1MiB", "--heartbeat-interval", "200ms"});
    AgentOptions o;
    o.endpoint = cluster.endpoint();
    o.name = "spill";
    session = std::make_unique<AgentSession>(o);
    device = session->pool().backend == Backend::Cuda ? E::Device::cuda(session->pool().device)
                                                      : E::Device::cpu();
    transfer = S::make_transfer(device);
    char tmpl[] = "/tmp/leasehold-spill-XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir = tmpl;
    E::set_conv_workspace_bytes(256 << 10);
  }
  void TearDown() override {
    E::set_conv_workspace_bytes(32ll << 20);
    session.reset();
    if (!dir.empty()) std::filesystem::remove_all(dir);
  }

  // A deep, narrow conv net: activations dominate its memory, and each
  // layer's working set is small next to all of them together.
  std::shared_ptr<E::nn::Sequential> model() {
    E::manual_seed(5);
    std::vector<std::shared_ptr<E::nn::Module>> layers{
        std::make_shared<E::nn::Conv2d>(1, 8, 3, 1, 1), std::make_shared<E::nn::ReLU>()};
    for (int i = 0; i < 8; ++i) {
      layers.push_back(std::make_shared<E::nn::Conv2d>(8, 8, 3, 1, 1));
      layers.push_back(std::make_shared<E::nn::ReLU>());
    }
    layers.push_back(std::make_shared<E::nn::MaxPool2d>(2));
    layers.push_back(std::make_shared<E::nn::Flatten>());
    layers.push_back(std::make_shared<E::nn::Linear>(8 * 14 * 14, 10));
    auto m = std::make_shared<E::nn::Sequential>(layers);
    m->to(device);
    return m;
  }

  // Trains `steps` steps inside a lease allocator of `budget` (0: none),
  // spilling through `store` when given.
  Outcome train(uint64_t budget, std::unique_ptr<S::SpillStore> store, int steps = 3) {
    auto alloc = std::make_shared<LeaseAllocator>(*session, LeaseAllocatorOptions::for_budget(budget));
    Outcome out;
    {
      E::AllocatorGuard guard(alloc);
      std::shared_ptr<S::SpillManager> manager;
      if (store) {
        S::SpillPolicy policy;
        policy.min_bytes = 64 << 10;
        manager = S::SpillManager::create(std::move(store), transfer, alloc, policy);
      }
      auto net = model();
      E::optim::Adam opt(net->named_parameters(), {.lr = 0.01});
      E::manual_seed(11);
      // A batch whose activations are many pages (2 MiB on a GPU), so a
      // budget at 45% of its peak is about the tensors, not page rounding.
      constexpr int64_t kBatch = 128;
      E::Tensor x = E::randn({kBatch, 1, 28, 28}).to(device);
      std::vector<int64_t> labels(kBatch);
      for (int i = 0; i < kBatch; ++i) labels[i] = i % 10;
      E::Tensor y = E::from_vector<int64_t>(labels, {kBatch}, device);
      {
        std::optional<E::SavedTensorHooksGuard> hooks;
        if (manager) {
          manager->keep_resident(net->parameters());
          hooks.emplace(manager);
        }
        for (int i = 0; i < steps; ++i) {
          opt.zero_grad();
          E::cross_entropy((*net)(x), y).backward();
          opt.step();
        }
      }
      for (auto& p : net->parameters()) {
        auto w = p.to_vector<float>();
        out.weights.insert(out.weights.end(), w.begin(), w.end());
        auto g = p.grad().to_vector<float>();
        out.grads.insert(out.grads.end(), g.begin(), g.end());
      }
      if (manager) {
        out.counters = manager->counters();
        out.stats = manager->store_stats();
        EXPECT_EQ(manager->entries(), 0u) << "every saved tensor is forgotten after backward";
      }
    }
    out.peak_leased = alloc->stats().peak_leased_bytes;
    out.peak_in_use = alloc->stats().peak_in_use_bytes;
    return out;
  }

  // A small GPT trained 13 steps (the ninth half a batch) inside a lease
  // allocator of `budget` (0: none) with saved tensors spilled to a memory
  // store, blocks recomputing as RecomputePolicy steps them (after each
  // step that spilled, or whose CUDA graph did not fit) and, on a GPU with
  // `graphs`, the steps as CUDA graphs once one ran within the budget.
  // With `retry`, a step that runs out of memory runs again with one policy
  // step more (RecomputePolicy::run_step), as the job runner's do.
  // A GPT of 4 blocks of width `dim` on batches of `batch` windows of 64
  // bytes, trained for 13 steps within `budget` (0: none).
  // `spill`: with a spill tier (false: a job whose spill settings allow no
  // host memory; nothing spills, and the policy has no spill manager).
  GptRun train_gpt(uint64_t budget, bool graphs, bool retry = true, int64_t batch = 32,
                   int64_t dim = 64, bool spill = true) {
    auto alloc =
        std::make_shared<LeaseAllocator>(*session, LeaseAllocatorOptions::for_budget(budget));
    GptRun r;
    E::AllocatorGuard guard(alloc);
    std::shared_ptr<S::SpillManager> manager;
    if (spill) {
      manager = S::SpillManager::create(std::make_unique<S::MemorySpillStore>(*transfer),
                                        transfer, alloc);
    }
    E::manual_seed(5);
    const int64_t kBatch = batch, kDim = dim;
    constexpr int64_t kT = 64;
    auto emb = std::make_shared<E::nn::Embedding>(256, kDim, kT);
    E::nn::Sequential net;
    net.push_back(emb);
    for (int i = 0; i < 4; ++i) {
      net.push_back(std::make_shared<E::nn::TransformerBlock>(kDim, 4, 0.1, 4));
    }
    net.push_back(std::make_shared<E::nn::LayerNorm>(kDim));
    net.push_back(std::make_shared<E::nn::TiedOutput>(emb));
    net.to(device);
    E::optim::Adam opt(net.named_parameters(), {.lr = 0.003});
    // (Its last step as the job's: Adam's state to host memory, on a GPU.)
    RecomputePolicy policy(net, manager, [&opt] { return opt.move_state_to_host(); });
    std::vector<int64_t> tokens(kBatch * kT), targets(kBatch * kT);
    for (size_t i = 0; i < tokens.size(); ++i) {
      tokens[i] = static_cast<int64_t>((i * 131 + 7) % 256);
      targets[i] = static_cast<int64_t>((i * 71 + 3) % 256);
    }
    E::Tensor x = E::from_vector(tokens, {kBatch, kT}, device);
    E::Tensor y = E::from_vector(targets, {kBatch * kT}, device);
    {
      if (manager) manager->keep_resident(net.parameters());
      E::SavedTensorHooksGuard hooks(manager);
      // (On a GPU labels are checked where the loss is, as a job's are: a
      // captured step cannot wait for the host.)
      std::optional<E::DeferredLabelCheck> labels;
      if (device.is_cuda()) labels.emplace(device);
      // As the job runner steps: on a GPU, as a CUDA graph from the second
      // step, once its arena fits the budget.
      bool steps_made_graph = false;  // (before this step)
      GraphedSteps steps(
          device,
          [&](const E::Tensor& in, const E::Tensor& out) {
            E::StepRandom random(17, opt.step_counter());
            opt.zero_grad();
            E::Tensor loss = E::cross_entropy(net(in).reshape({-1, 256}), out);
            loss.backward();
            opt.step();
            return loss;
          },
          {.enabled = graphs && device.is_cuda(),
           .full_batch = kBatch,
           .need_less =
               [&](const std::string&) {
                 if (!policy.tighten()) return false;
                 ++r.need_less_steps;
                 r.need_less_after_graph += steps_made_graph;
                 return true;
               },
           .release = [&] { opt.zero_grad(); }});
      // Step 9 is half a batch, as an epoch's last can be: it runs op by op
      // in the memory the graph's idle arena gives up.
      // (Steps 12 and 13: room for one retry should the graph made again
      // after it not fit beside what the half batch left.)
      for (int i = 0; i < 13; ++i) {
        if (i == 8) r.graph_steps_before_half = steps.graph_steps();
        steps_made_graph = steps.graph_steps() > 0;
        auto step = [&] {
          if (i == 8) {
            steps.run(x.narrow(0, 0, kBatch / 2), y.narrow(0, 0, kBatch / 2 * kT));
          } else {
            steps.run(x, y);
          }
        };
        const int again = policy.run_step(step, [&] {
          if (manager) manager->end_step();
          return retry && opt.steps() == i;
        });
        if (again > 0) steps.retry();
        r.retries += again;
        if (manager) manager->end_step();
        // As the job runner does: one policy step after a step that spilled
        // (once its graph was tried), or after a graph whose arena did not
        // fit, and the graph tried again.
        if (!steps.holds_graph() && !steps.graph_pending()) {
          const RecomputePolicy::Step why = policy.after_step(steps.graph_did_not_fit());
          r.graphs_that_did_not_fit += why == RecomputePolicy::Step::GraphDidNotFit;
          if (why != RecomputePolicy::Step::None) steps.retry();
        }
        r.evictions.push_back(manager ? manager->counters().evictions : 0);
        r.copied_out.push_back(manager ? manager->store_stats().bytes_out : 0);
      }
      r.graph_steps = steps.graph_steps();
      r.releases = steps.releases();
    }
    for (auto& p : net.parameters()) {
      auto w = p.to_vector<float>();
      r.weights.insert(r.weights.end(), w.begin(), w.end());
    }
    r.mlps = policy.mlps();
    r.whole = policy.whole();
    r.halves = policy.halves();
    r.mlps_sliced = policy.mlps_sliced();
    r.peak_in_use = alloc->stats().peak_in_use_bytes;
    return r;
  }

  uint64_t tight_budget() {
    if (!reference_) reference_ = train(0, nullptr);
    // Well under the unconstrained peak (what its tensors needed at once,
    // not what it happened to lease), above what one layer needs at once;
    // plus two pages (2 MiB each on a GPU) for the partly used pages at the
    // ends of live tensors, which a budget in pages pays for.
    const uint64_t page = session->pool().alignment;
    return align_up(reference_->peak_in_use * 45 / 100, page) + 2 * page;
  }

  void expect_same_as_unconstrained(const Outcome& o, uint64_t budget) {
    ASSERT_TRUE(reference_);
    EXPECT_LE(o.peak_leased, budget) << "the budget held";
    EXPECT_GT(o.counters.evictions, 0u) << "the budget forced spilling";
    EXPECT_GT(o.counters.restores, 0u);
    ASSERT_EQ(o.weights.size(), reference_->weights.size());
    EXPECT_TRUE(o.weights == reference_->weights) << "weights differ from the unconstrained run";
    EXPECT_TRUE(o.grads == reference_->grads) << "gradients differ from the unconstrained run";
  }

  S::TieredStoreOptions tiered(uint64_t host_bytes, bool file) {
    S::TieredStoreOptions o;
    if (host_bytes) {
      host = std::make_unique<S::PinnedBuffer>(host_bytes, device);
      o.host_tier = host.get();
    }
    if (file) {
      staging = std::make_unique<S::PinnedBuffer>(8u << 20, device);
      o.staging = staging.get();
      o.chunk_bytes = 256 << 10;
      o.directory = dir;
      o.tag = "test";
    }
    return o;
  }

  Cluster cluster;
  std::unique_ptr<AgentSession> session;
  E::Device device;
  std::shared_ptr<S::Transfer> transfer;
  std::string dir;
  std::unique_ptr<S::PinnedBuffer> host, staging;
  std::optional<Outcome> reference_;
};

TEST_F(SpillTraining, WithoutABudgetNothingSpills) {
  Outcome o = train(0, std::make_unique<S::MemorySpillStore>(*transfer));
  Outcome plain = train(0, nullptr);
  EXPECT_EQ(o.counters.evictions, 0u);
  EXPECT_EQ(o.stats.bytes_out, 0u);
  EXPECT_TRUE(o.weights == plain.weights);
}

TEST_F(SpillTraining, WithoutSpillingTheTightBudgetRunsOutOfMemory) {
  uint64_t budget = tight_budget();
  EXPECT_THROW(train(budget, nullptr), E::OutOfMemoryError);
}

TEST_F(SpillTraining, MemoryStoreTrainsBitIdentically) {
  uint64_t budget = tight_budget();
  expect_same_as_unconstrained(train(budget, std::make_unique<S::MemorySpillStore>(*transfer)),
                               budget);
}

TEST_F(SpillTraining, HostTierTrainsBitIdentically) {
  uint64_t budget = tight_budget();
  Outcome o = train(budget, std::make_unique<S::TieredSpillStore>(*transfer, tiered(64u << 20, false)));
  expect_same_as_unconstrained(o, budget);
  EXPECT_GT(o.stats.peak_host_bytes, 0u);
  EXPECT_EQ(o.stats.peak_file_bytes, 0u);
}

TEST_F(SpillTraining, FileTierTrainsBitIdentically) {
  uint64_t budget = tight_budget();
  Outcome o = train(budget, std::make_unique<S::TieredSpillStore>(*transfer, tiered(0, true)));
  expect_same_as_unconstrained(o, budget);
  EXPECT_EQ(o.stats.peak_host_bytes, 0u);
  EXPECT_GT(o.stats.file_bytes_written, 0u);
  EXPECT_GT(o.stats.file_bytes_read + o.stats.staging_hits, 0u);
  // The store is gone with the run, and its file with it.
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

TEST_F(SpillTraining, BothTiersTrainBitIdentically) {
  uint64_t budget = tight_budget();
  Outcome o = train(budget, std::make_unique<S::TieredSpillStore>(*transfer, tiered(8u << 20, true)));
  expect_same_as_unconstrained(o, budget);
  EXPECT_GT(o.stats.peak_host_bytes, 0u);
  EXPECT_GT(o.stats.peak_file_bytes, 0u);
}

// A store that fails: the run fails with the store's reason, and every lease
// is back with the coordinator afterwards (the next run gets the memory).
class FailingStore : public SpillTraining {
 protected:
  void expect_failure(std::unique_ptr<S::SpillStore> store, const std::string& expected) {
    uint64_t budget = tight_budget();
    try {
      train(budget, std::move(store));
      FAIL() << "the run succeeded although the store failed";
    } catch (const S::SpillError& e) {
      EXPECT_NE(std::string(e.what()).find(expected), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("saved tensor #"), std::string::npos) << e.what();
    }
    // All leases went back: an unconstrained run after it still trains the same.
    Outcome again = train(0, nullptr);
    EXPECT_TRUE(again.weights == reference_->weights);
  }
  S::MemorySpillStore* inner() {
    if (!inner_) inner_ = std::make_unique<S::MemorySpillStore>(*transfer);
    return inner_.get();
  }
  std::unique_ptr<S::MemorySpillStore> inner_;
};

TEST_F(FailingStore, NoSpaceFromTheThirdPutOnFailsTheRun) {
  auto store = std::make_unique<S::FaultInjectingSpillStore>(*inner());
  store->fail_puts_from(3);
  expect_failure(std::move(store), "No space left on device");
}

// A copy made ahead of need that finds no room is only skipped: one full
// moment of the disk fails nothing when later puts find room again.
TEST_F(FailingStore, OneFailedPutAheadOfNeedIsSkipped) {
  uint64_t budget = tight_budget();
  S::FaultInjectingSpillStore faults(*inner());
  faults.fail_put_at(3);  // with the default policy, a copy ahead
  // The run owns a plain forwarder, so `faults` outlives it.
  Outcome o = train(budget, std::make_unique<S::FaultInjectingSpillStore>(
                                static_cast<S::SpillStore&>(faults)));
  EXPECT_GT(faults.puts(), 3u);
  expect_same_as_unconstrained(o, budget);
}

TEST_F(FailingStore, ReadErrorFailsTheRun) {
  auto store = std::make_unique<S::FaultInjectingSpillStore>(*inner());
  for (S::SpillId id = 1; id < 10000; ++id) store->fail_get_of(id);
  expect_failure(std::move(store), "Input/output error");
}

TEST_F(FailingStore, ChecksumMismatchFailsTheRun) {
  auto store = std::make_unique<S::FaultInjectingSpillStore>(*inner());
  for (S::SpillId id = 1; id < 10000; ++id) store->corrupt_get_of(id);
  expect_failure(std::move(store), "Corruption");
}

TEST_F(FailingStore, AFullSpillFileFailsTheRunNamingTheFile) {
  S::TieredStoreOptions o = tiered(0, true);
  o.file_limit = 1u << 20;
  expect_failure(std::make_unique<S::TieredSpillStore>(*transfer, o), dir);
}

// A GPT over its budget: after each step that spilled, one more MLP, then
// one more whole block (or its halves apart, once a recomputed backward
// was over the budget), recomputes in backward instead (RecomputePolicy),
// until the steps fit without spilling; on a GPU they then run as a CUDA
// graph (one more recomputes whenever the graph's arena does not fit
// beside what else lives, and the graph is traced again at once, as the
// job runner steps); and the run still ends
// bit for bit as the run without a budget, op by op, does (dropout on: its
// masks are drawn again in the recomputed blocks).
TEST_F(SpillTraining, AGptOverItsBudgetRecomputesBlocksUntilItStopsSpilling) {
  const GptRun free_run = train_gpt(0, false);
  EXPECT_EQ(free_run.mlps + free_run.whole + free_run.halves, 0) << "nothing to keep within";
  EXPECT_EQ(free_run.evictions.back(), 0u);
  const uint64_t page = session->pool().alignment;
  const GptRun tight =
      train_gpt(align_up(free_run.peak_in_use * 60 / 100, page) + 2 * page, true);
  EXPECT_GT(tight.evictions.front(), 0u) << "the first step spilled";
  EXPECT_GE(tight.mlps + tight.whole + tight.halves, 1);
  EXPECT_TRUE(tight.whole + tight.halves == 0 || tight.mlps + tight.whole + tight.halves == 4)
      << "MLPs first, then whole blocks or halves";
  const size_t n = tight.evictions.size();
  EXPECT_EQ(tight.evictions[n - 1], tight.evictions[n - 3]) << "the last two steps did not spill";
  EXPECT_EQ(tight.copied_out[n - 1], tight.copied_out[n - 2])
      << "nor did the last copy anything out ahead: the step before needed no room";
  // (The MLPs in slices would give the weights within rounding, not the
  // bits: this budget stops before them.)
  EXPECT_FALSE(tight.mlps_sliced) << "the budget took the MLPs to slices";
  EXPECT_TRUE(tight.weights == free_run.weights) << "weights differ from the run without a budget";
  EXPECT_EQ(tight.retries, 0) << "no step ran out of memory: each spilled what it could not keep";
  if (device.is_cuda()) {
    // Settled, the step fits the budget as a CUDA graph too: its memory is
    // laid out in an arena of the step's peak (step_graph.h). The half
    // batch needs that memory: the graph gives it up (nothing spills for
    // it) and is made again for the full batches after it.
    EXPECT_GT(tight.graph_steps_before_half, 0) << "the steps never became a CUDA graph";
    // The first step spilled op by op; the graph's arena then decided, and
    // each level that did not fit was traced again at once.
    EXPECT_GT(tight.need_less_steps, 0) << "no level was taken for the graph's arena";
    EXPECT_EQ(tight.releases, 1);
    EXPECT_EQ(tight.evictions[8], tight.evictions[7]) << "the half batch spilled";
    EXPECT_GT(tight.graph_steps, tight.graph_steps_before_half) << "no graph after the half batch";
    // At most one policy step for it: the half batch, op by op, can leave a
    // small tensor on a page of its own (on an H200: 2.61 MiB live on three
    // pages of 2 MiB), and the arena, 12 pages under a budget of 14, then
    // needs one thing more recomputed; a second would mean the retry did
    // not bring it within the budget.
    EXPECT_LE(tight.graphs_that_did_not_fit + tight.need_less_after_graph, 1);
  }
}

// A budget under what the first steps keep (they recompute little yet),
// though not under what a step that recomputes more needs, for a job
// without a spill tier: a step runs out of memory outright. Run again with
// one policy step more each time it does (RecomputePolicy::run_step, as
// the job runner runs steps), the job reaches a step that fits and trains
// on, bit for bit as without a budget; without, the run ends there. The
// largest budget, in pages from 60% of the peak down, at which a run
// without retries fails, or one of the next two such, must train with
// them; where the step fits only with its MLPs run again in slices of
// the batch, within rounding (their weights' gradients are sums over the
// slices). (With a spill tier such budgets are a narrow band that the
// engine's own memory savings move: a segment run again letting its
// output go closed the one this test had used. Without one, the band is
// everything between what the last policy step and the first need.) The
// blocks are twice as wide on half the batch: their activations, not the
// output layer's, decide what a step needs at once.
TEST_F(SpillTraining, AStepThatRunsOutOfMemoryRunsAgainRecomputingMore) {
  constexpr int64_t kBatch = 16, kDim = 128;
  const GptRun free_run = train_gpt(0, false, true, kBatch, kDim);
  const uint64_t page = session->pool().alignment;
  const uint64_t lowest = free_run.peak_in_use / 5;
  uint64_t budget = 0;
  int failed_without_retries = 0;
  GptRun retried;
  std::string ran_out;  // budgets that ran out with retries too
  for (uint64_t b = align_up(free_run.peak_in_use * 3 / 5, page);
       b >= lowest && !budget && failed_without_retries < 3; b -= page) {
    try {
      train_gpt(b, true, /*retry=*/false, kBatch, kDim, /*spill=*/false);
      continue;
    } catch (const E::OutOfMemoryError&) {
      ++failed_without_retries;
    }
    try {
      retried = train_gpt(b, true, /*retry=*/true, kBatch, kDim, /*spill=*/false);
      budget = b;
    } catch (const E::OutOfMemoryError& e) {
      ran_out += "\n" + std::to_string(b / page) + " pages: " + e.what();
    }
  }
  ASSERT_NE(budget, 0u) << "no budget from 60% to 20% of the peak ran out of memory without "
                           "retries and trained with them"
                        << ran_out;
  EXPECT_GE(retried.retries, 1);
  if (retried.mlps_sliced) {
    EXPECT_LT(weight_distance(retried.weights, free_run.weights), 1e-4)
        << "weights far from the run without a budget";
  } else {
    EXPECT_TRUE(retried.weights == free_run.weights)
        << "weights differ from the run without a budget";
  }
}

}  // namespace
}  // namespace leasehold::testing
