// What makes a training step replayable as a CUDA graph, checked on the
// CPU: the optimizer's step counter and the schedule read where the update
// runs, a step's random numbers from its seed and number alone, the graph's
// memory pool and the frees deferred during a capture. (The capture itself
// and the replay's bits: tests/engine/cuda_graph_test.cpp, on a GPU.)
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <set>
#include <utility>
#include <vector>

#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "agent/engine/step_graph.h"
#include "tests/engine/fused_check.h"

namespace leasehold::engine {
namespace {

Tensor step_counter(int64_t n) { return from_vector<int64_t>({n}, {}); }

TEST(StepRandom, MasksDependOnTheSeedTheStepAndTheOpsPlaceAlone) {
  const Tensor x = ones({4096});
  auto masks = [&](uint64_t seed, int64_t step) {
    Tensor counter = step_counter(step);
    StepRandom scope(seed, counter);
    return std::pair{dropout(x, 0.5, true).to_vector<float>(),
                     dropout(x, 0.5, true).to_vector<float>()};
  };
  manual_seed(1);
  const auto a = masks(7, 3);
  manual_seed(2);  // the engine's generator plays no part
  const auto b = masks(7, 3);
  EXPECT_EQ(a, b);
  EXPECT_NE(a.first, a.second) << "the second op of a step draws its own";
  EXPECT_NE(masks(7, 4).first, a.first) << "another step";
  EXPECT_NE(masks(8, 3).first, a.first) << "another seed";

  // The counter is read when the mask is drawn, not when the scope begins:
  // what a graph's replay sees after the optimizer advanced it.
  Tensor counter = step_counter(3);
  StepRandom scope(7, counter);
  counter.copy_(step_counter(4));
  EXPECT_EQ(dropout(x, 0.5, true).to_vector<float>(), masks(7, 4).first);
}

// A residual connection's dropout and addition in one pass: the same mask
// and the same bits as the two operations (fused_check.h).
TEST(StepRandom, AddDropoutIsDropoutThenAddBitForBit) {
  EXPECT_EQ(add_dropout_mismatch(Device::cpu()), "");
  // Bad input is named: shapes that differ, a residual of another type, p.
  const auto error = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const std::string shapes = error([] { add_dropout(ones({4}), ones({5}), 0.1, true); });
  EXPECT_NE(shapes.find("add_dropout: residual [4] and input [5] differ in shape"),
            std::string::npos)
      << shapes;
  const std::string types =
      error([] { add_dropout(ones({4}).to(DType::Float64), ones({4}), 0.1, true); });
  EXPECT_EQ(types.rfind("add_dropout", 0), 0u) << types;
  const std::string p = error([] { add_dropout(ones({4}), ones({4}), 1.0, true); });
  EXPECT_NE(p.find("add_dropout: p = 1.000000 must be in [0, 1)"), std::string::npos) << p;
  // A bfloat16 branch outside autocast (the CPU never runs it), and
  // bfloat16 dropout alone, are named before anything is drawn.
  for (const auto& bf16 : {error([] {
                             add_dropout(ones({4}), ones({4}).to(DType::BFloat16), 0.1, true);
                           }),
                           error([] { dropout(ones({4}).to(DType::BFloat16), 0.1, true); })}) {
    EXPECT_NE(bf16.find("a bfloat16 input is taken only as add_dropout's branch"),
              std::string::npos)
        << bf16;
  }
}

TEST(StepRandom, OutsideAScopeTheGeneratorDrawsAndScopesNest) {
  const Tensor x = ones({512});
  manual_seed(5);
  const auto a = dropout(x, 0.5, true).to_vector<float>();
  manual_seed(5);
  {
    Tensor outer = step_counter(1), inner = step_counter(2);
    StepRandom s1(1, outer);
    { StepRandom s2(2, inner); }
  }
  EXPECT_EQ(dropout(x, 0.5, true).to_vector<float>(), a);
  EXPECT_THROW(StepRandom(1, zeros({2}, {DType::Int64})), std::invalid_argument);
  EXPECT_THROW(StepRandom(1, zeros({})), std::invalid_argument) << "float32";
}

// Adam reads the step's number and rate from its counter: a schedule set
// once gives every step its own rate, and the counter resumes.
TEST(OptimizerSteps, TheCounterDrivesTheScheduleAndBiasCorrection) {
  const optim::LrSchedule sched{.lr = 0.1, .min_lr = 0.01, .warmup = 2, .total = 6};
  Tensor p = from_vector<double>({1.0, -0.5}, {2}).set_requires_grad(true);
  optim::Adam opt({{"p", p}}, {.lr = 1.0});
  opt.set_schedule(sched);
  double ref[2] = {1.0, -0.5}, m[2] = {0, 0}, v[2] = {0, 0};
  for (int64_t t = 1; t <= 8; ++t) {
    EXPECT_DOUBLE_EQ(opt.lr(), sched.at(t - 1));
    opt.zero_grad();
    sum(pow(p, 2.0)).backward();
    opt.step();
    EXPECT_EQ(opt.steps(), t);
    for (int i = 0; i < 2; ++i) {
      const double g = 2 * ref[i];
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.999 * v[i] + 0.001 * g * g;
      const double mh = m[i] / (1 - std::pow(0.9, t)), vh = v[i] / (1 - std::pow(0.999, t));
      ref[i] -= sched.at(t - 1) * mh / (std::sqrt(vh) + 1e-8);
    }
    const auto got = p.to_vector<double>();
    for (int i = 0; i < 2; ++i) ASSERT_NEAR(got[i], ref[i], 1e-12) << "step " << t;
  }
  opt.set_steps(2);
  EXPECT_EQ(opt.steps(), 2);
  EXPECT_DOUBLE_EQ(opt.lr(), sched.at(2));
  EXPECT_THROW(opt.set_steps(-1), std::invalid_argument);
  EXPECT_THROW(opt.set_schedule({.lr = 0.1, .min_lr = 0, .warmup = 0, .total = 5}),
               std::invalid_argument)
      << "a floor of 0";
  EXPECT_THROW(opt.set_schedule({.lr = 0.1, .min_lr = 0.01, .warmup = 0, .total = 0}),
               std::invalid_argument);
  EXPECT_THROW(opt.set_lr(-1), std::invalid_argument);
}

TEST(OptimizerSteps, SgdCountsTooAndItsCheckpointKeepsTheCount) {
  Tensor p = from_vector<double>({1.0}, {1}).set_requires_grad(true);
  optim::SGD opt({{"p", p}}, {.lr = 0.5, .momentum = 0.9});
  opt.set_schedule({.lr = 0.5, .min_lr = 0.05, .warmup = 0, .total = 4});
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    sum(mul(p, 1.0)).backward();
    opt.step();
  }
  // Rates 0.5, then the cosine's at steps 1 and 2; gradient 1, momentum 0.9.
  const optim::LrSchedule s{.lr = 0.5, .min_lr = 0.05, .warmup = 0, .total = 4};
  const double expected = 1.0 - s.at(0) * 1 - s.at(1) * 1.9 - s.at(2) * 2.71;
  EXPECT_NEAR(p.to_vector<double>()[0], expected, 1e-12);

  Tensor q = from_vector<double>({1.0}, {1}).set_requires_grad(true);
  optim::SGD resumed({{"q", q}}, {.lr = 0.5, .momentum = 0.9});
  auto state = opt.state();
  for (auto& [name, t] : state) {
    if (name.rfind("sgd.momentum.", 0) == 0) name = "sgd.momentum.q";
  }
  resumed.load_state(state);
  EXPECT_EQ(resumed.steps(), 3);
}

// A counting allocator under the pool, on the host.
class Upstream final : public Allocator {
 public:
  void* allocate(size_t bytes) override {
    if (limit && in_use + bytes > limit) throw OutOfMemoryError("over the test's limit", bytes);
    void* p = ::operator new(bytes);
    live[p] = bytes;
    in_use += bytes;
    ++allocations;
    return p;
  }
  void deallocate(void* p, size_t bytes) noexcept override {
    EXPECT_EQ(live.at(p), bytes);
    live.erase(p);
    in_use -= bytes;
    ::operator delete(p);
  }
  Device device() const override { return Device::cpu(); }
  AllocatorStats stats() const override { return {}; }
  std::map<void*, size_t> live;
  uint64_t in_use = 0, limit = 0;
  int allocations = 0;
};

// Addresses for the pools' traces, on the host: far more than they use.
constexpr uint64_t kTraceBytes = 1 << 20;

// The trace takes nothing upstream: its allocations are addresses of a
// reserved range with no memory behind them. The capture's same
// allocations get their places in one arena of the trace's peak. As a job
// does it, what the trace left (the gradients) is freed before the arena
// is laid out.
TEST(GraphPool, TheCaptureGetsTheTracedAllocationsFromOneArenaOfTheirPeak) {
  auto up = std::make_shared<Upstream>();
  {
    auto pool = std::make_shared<GraphPool>(up, kTraceBytes);
    auto step = [&] {
      void* a = pool->allocate(1024);
      void* b = pool->allocate(512);
      pool->deallocate(a, 1024);
      void* c = pool->allocate(768);
      pool->deallocate(b, 512);
      pool->deallocate(c, 768);
      return pool->allocate(2048);  // left live, as a gradient is
    };
    void* kept = step();
    EXPECT_EQ(up->allocations, 0) << "a trace takes no memory";
    EXPECT_EQ(pool->held_bytes(), 0u);
    EXPECT_EQ(pool->live_allocations(), 1u);
    EXPECT_EQ(pool->stats().peak_in_use_bytes, 2048u) << "the trace's bytes are counted";
    pool->deallocate(kept, 2048);
    pool->plan();
    EXPECT_EQ(pool->held_bytes(), 2048u) << "an arena of the peak, not of every size's";
    EXPECT_EQ(pool->peak_live_bytes(), 2048u);
    EXPECT_EQ(up->allocations, 1);
    pool->set_capturing(true);
    void* again = step();
    EXPECT_EQ(pool->capture_mismatch(), "");
    pool->set_capturing(false);
    EXPECT_EQ(up->live.size(), 1u) << "the arena alone";
    EXPECT_EQ(up->live.begin()->first, again) << "the largest block at the arena's start";
    EXPECT_EQ(pool->stats().in_use_bytes, 2048u);
    EXPECT_EQ(pool->stats().cached_bytes, 0u);
    EXPECT_THROW(pool->allocate(64), std::logic_error) << "a captured pool serves no more";
    pool->deallocate(again, 2048);
    EXPECT_EQ(pool->stats().cached_bytes, 2048u);
  }
  EXPECT_TRUE(up->live.empty()) << "the arena back upstream when the pool goes";
}

// A trace's addresses (of a range reserved for it) are distinct while live,
// and one freed is reused for the same size.
TEST(GraphPool, ATracesAddressesAreDistinctWhileLiveAndReusedBySize) {
  auto up = std::make_shared<Upstream>();
  GraphPool pool(up, kTraceBytes);
  std::set<void*> live;
  std::vector<std::pair<void*, size_t>> made;
  for (size_t bytes : {512u, 4096u, 100u, 512u, 70000u}) {
    void* p = pool.allocate(bytes);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % TraceAddresses::kAlignment, 0u);
    EXPECT_TRUE(live.insert(p).second) << "two live allocations at one address";
    made.emplace_back(p, bytes);
  }
  auto [first, first_bytes] = made.front();
  pool.deallocate(first, first_bytes);
  EXPECT_EQ(pool.allocate(512), first) << "reused for its size";
  EXPECT_NE(pool.allocate(512), first);
  EXPECT_EQ(up->allocations, 0);
}

// A tensor of the trace has no memory behind it: one alive when the step
// is laid out is the caller's error, named, and nothing is taken upstream.
TEST(GraphPool, ATracedTensorStillAliveAtThePlanIsAnError) {
  auto up = std::make_shared<Upstream>();
  GraphPool pool(up, kTraceBytes);
  void* kept = pool.allocate(1024);
  try {
    pool.plan();
    ADD_FAILURE() << "planned with a traced tensor alive";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("1 tensors of the traced step are still alive"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(up->allocations, 0);
  pool.deallocate(kept, 1024);
  pool.plan();
  EXPECT_EQ(pool.held_bytes(), 1024u);
}

// A step whose trace needs more addresses than reserved cannot fit as a
// graph: an OutOfMemoryError, as for an arena upstream cannot give.
TEST(GraphPool, ATraceOverItsAddressesIsAnOutOfMemoryError) {
  auto up = std::make_shared<Upstream>();
  GraphPool pool(up, 4 << 20);  // (rounded to a 2 MiB multiple: 4 MiB)
  void* a = pool.allocate(3 << 20);
  EXPECT_THROW(pool.allocate(2 << 20), OutOfMemoryError);
  pool.deallocate(a, 3 << 20);
  void* b = pool.allocate(3 << 20);
  EXPECT_EQ(a, b) << "the same size, given back, fits again";
  pool.deallocate(b, 3 << 20);
  EXPECT_EQ(up->allocations, 0);
}

// Addresses given back merge with their neighbours and with the range's
// unused end, so a trace whose sizes change reuses them: in 4 MiB, sizes
// growing from 1 to 4 MiB, each given back before the next, all fit (each
// size apart would need 10 MiB), and two adjacent 1 MiB runs given back
// hold a 2 MiB tensor, at the first one's address; a run is split for a
// smaller size, its rest given back still.
TEST(GraphPool, ATracesAddressesGivenBackMergeWithTheirNeighbours) {
  auto up = std::make_shared<Upstream>();
  GraphPool pool(up, 4 << 20);
  for (size_t mib = 1; mib <= 4; ++mib) {
    void* p = pool.allocate(mib << 20);
    pool.deallocate(p, mib << 20);
  }
  void* a = pool.allocate(1 << 20);
  void* b = pool.allocate(1 << 20);
  void* c = pool.allocate(1 << 20);
  void* d = pool.allocate(1 << 20);
  EXPECT_THROW(pool.allocate(512), OutOfMemoryError) << "every address is live";
  pool.deallocate(b, 1 << 20);
  pool.deallocate(c, 1 << 20);
  void* bc = pool.allocate(2 << 20);
  EXPECT_EQ(bc, b) << "the two runs given back, merged";
  pool.deallocate(bc, 2 << 20);
  void* half = pool.allocate(512 << 10);
  EXPECT_EQ(half, b) << "the merged run's start";
  void* rest = pool.allocate(1536 << 10);
  EXPECT_EQ(static_cast<char*>(rest), static_cast<char*>(b) + (512 << 10)) << "its rest";
  for (auto [p, bytes] : std::vector<std::pair<void*, size_t>>{
           {a, 1 << 20}, {half, 512 << 10}, {rest, 1536 << 10}, {d, 1 << 20}}) {
    pool.deallocate(p, bytes);
  }
  void* whole = pool.allocate(4 << 20);
  EXPECT_EQ(whole, a) << "all given back: the whole range again";
  pool.deallocate(whole, 4 << 20);
  EXPECT_EQ(up->allocations, 0);
}

TEST(GraphPool, ACaptureThatAllocatesOtherwiseThanItsTraceThrows) {
  auto up = std::make_shared<Upstream>();
  GraphPool pool(up, kTraceBytes);
  pool.deallocate(pool.allocate(4096), 4096);
  pool.deallocate(pool.allocate(4096), 4096);
  pool.plan();
  pool.set_capturing(true);
  auto expect_error = [](const std::function<void()>& f, const std::string& want) {
    try {
      f();
      ADD_FAILURE() << "no error; wanted: " << want;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  expect_error([&] { pool.allocate(8192); },
               "allocation 1 is of 8.00 KiB, its trace's of 4.00 KiB");
  EXPECT_NE(pool.capture_mismatch().find("made 0 allocations, its trace 2"), std::string::npos);
  // The two shared one place because the trace freed the first before
  // making the second: keeping it alive would make them overlap.
  void* a = pool.allocate(4096);
  expect_error([&] { pool.allocate(4096); },
               "keeps its allocation 1 (4.00 KiB) alive longer than its trace did");
  pool.deallocate(a, 4096);
  void* b = pool.allocate(4096);
  expect_error([&] { pool.allocate(4096); }, "its trace made only 2");
  pool.deallocate(b, 4096);
  EXPECT_EQ(pool.capture_mismatch(), "");
  pool.set_capturing(false);
  EXPECT_EQ(up->live.size(), 1u);
}

TEST(GraphPool, AnArenaUpstreamCannotGiveIsAnOutOfMemoryError) {
  auto up = std::make_shared<Upstream>();
  up->limit = 3000;
  GraphPool pool(up, kTraceBytes);
  void* a = pool.allocate(2048);
  void* b = pool.allocate(1024);
  pool.deallocate(a, 2048);
  pool.deallocate(b, 1024);
  EXPECT_THROW(pool.plan(), OutOfMemoryError) << "2048 + 1024 live at once, over 3000";
  EXPECT_TRUE(up->live.empty());
}

TEST(DeferFreesGuard, FreesWaitForTheGuardExceptThePoolsOwn) {
  auto up = std::make_shared<Upstream>();
  auto pool = std::make_shared<GraphPool>(up, kTraceBytes);
  Tensor outside, inside;
  {
    AllocatorGuard use(up);
    outside = empty({64});
  }
  {
    AllocatorGuard use(pool);
    inside = empty({64});
  }
  void* outside_block = outside.data<float>();
  {
    DeferFreesGuard defer(pool.get());
    outside = Tensor();
    inside = Tensor();
    EXPECT_TRUE(up->live.count(outside_block)) << "deferred";
    EXPECT_EQ(pool->stats().in_use_bytes, 0u) << "the pool's own: freed at once";
    EXPECT_TRUE(defer.all_deferred());
  }
  EXPECT_FALSE(up->live.count(outside_block));
}

TEST(StepGraph, OnTheCpuTheCallerRunsTheStep) {
  int runs = 0;
  StepGraph graph(Device::cpu(), [&] { ++runs; });
  EXPECT_FALSE(graph.run());
  EXPECT_EQ(runs, 0);
  EXPECT_NE(graph.why_not().find("CPU"), std::string::npos) << graph.why_not();
  EXPECT_FALSE(graph.replaying());
}

}  // namespace
}  // namespace leasehold::engine
