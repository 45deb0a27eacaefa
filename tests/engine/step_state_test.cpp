// What makes a training step replayable as a CUDA graph, checked on the
// CPU: the optimizer's step counter and the schedule read where the update
// runs, a step's random numbers from its seed and number alone, the graph's
// memory pool and the frees deferred during a capture. (The capture itself
// and the replay's bits: tests/engine/cuda_graph_test.cpp, on a GPU.)
#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "agent/engine/step_graph.h"

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
  explicit Upstream(bool on_stream) : on_stream_(on_stream) {}
  void* allocate(size_t bytes) override {
    void* p = ::operator new(bytes);
    live[p] = bytes;
    ++allocations;
    return p;
  }
  void deallocate(void* p, size_t bytes) noexcept override {
    EXPECT_EQ(live.at(p), bytes);
    live.erase(p);
    ::operator delete(p);
  }
  Device device() const override { return Device::cpu(); }
  AllocatorStats stats() const override { return {}; }
  bool on_stream() const override { return on_stream_; }
  std::map<void*, size_t> live;
  int allocations = 0;

 private:
  bool on_stream_;
};

TEST(GraphPool, ReusesBlocksOfTheSameSizeAndReturnsThemAllWhenItGoes) {
  auto up = std::make_shared<Upstream>(false);
  {
    auto pool = std::make_shared<GraphPool>(up);
    void* a = pool->allocate(1024);
    void* b = pool->allocate(512);
    pool->deallocate(a, 1024);
    EXPECT_EQ(pool->allocate(1024), a) << "the same size: the same block";
    void* c = pool->allocate(2048);
    pool->deallocate(b, 512);
    EXPECT_NE(pool->allocate(256), b) << "another size: a block of its own";
    EXPECT_EQ(up->allocations, 4);
    EXPECT_EQ(pool->held_bytes(), 1024u + 512 + 2048 + 256);
    const AllocatorStats st = pool->stats();
    EXPECT_EQ(st.in_use_bytes, 1024u + 2048 + 256);
    EXPECT_EQ(st.cached_bytes, 512u);
    (void)c;
  }
  EXPECT_TRUE(up->live.empty()) << "every block back upstream, in use or not";
}

TEST(GraphPool, WhileCapturingItTakesNoBlockFromAnAllocatorOnTheStream) {
  auto on_stream = std::make_shared<Upstream>(true);
  GraphPool pool(on_stream);
  void* a = pool.allocate(4096);
  pool.deallocate(a, 4096);
  pool.set_capturing(true);
  EXPECT_EQ(pool.allocate(4096), a) << "a block it holds";
  EXPECT_THROW(pool.allocate(8192), std::runtime_error);
  pool.deallocate(a, 4096);
  EXPECT_EQ(pool.allocate(100), a) << "a larger free block rather than none";
  EXPECT_THROW(pool.allocate(100), std::runtime_error) << "none left";
  EXPECT_EQ(on_stream->allocations, 1);
  pool.set_capturing(false);
  pool.deallocate(a, 100);
  EXPECT_EQ(pool.stats().cached_bytes, 4096u) << "freed as the block it is";
  EXPECT_EQ(pool.allocate(4096), a);
  pool.deallocate(a, 4096);

  auto off_stream = std::make_shared<Upstream>(false);  // the lease allocator's kind
  GraphPool lease_pool(off_stream);
  lease_pool.set_capturing(true);
  void* b = lease_pool.allocate(8192);
  lease_pool.deallocate(b, 8192);
}

TEST(DeferFreesGuard, FreesWaitForTheGuardExceptThePoolsOwn) {
  auto up = std::make_shared<Upstream>(false);
  auto pool = std::make_shared<GraphPool>(up);
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
