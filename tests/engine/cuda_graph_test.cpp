// Whole training steps as CUDA graphs: a step replayed from a graph ends
// bit for bit as the same step launched op by op (a GPT with dropout,
// AdamW, a cosine schedule and clipping, in float32 and under bf16
// autocast; a CNN with SGD and momentum), replays make the host wait for
// nothing, and a step that cannot be captured runs op by op with nothing
// changed. Skipped without a GPU.
#include <gtest/gtest.h>

#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine/host_offload.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "agent/engine/step_graph.h"
#include "shared/device.h"

namespace leasehold::engine {
namespace {

using namespace nn;

class CudaGraphTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_built()) GTEST_SKIP() << "built without CUDA";
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible";
  }
  const Device gpu = Device::cuda(0);
};

// A model, its optimizer and where its batches come from.
struct Trainee {
  std::shared_ptr<Sequential> model;
  std::unique_ptr<optim::Optimizer> opt;
  int64_t classes = 0;
};

using MakeTrainee = std::function<Trainee(Device)>;
using MakeBatch = std::function<void(int64_t step, Tensor& x, Tensor& y)>;

// `blocks` transformer blocks.
Trainee tiny_gpt_of(Device d, uint64_t blocks) {
  manual_seed(11);
  const TensorOptions o{DType::Float32, d};
  auto emb = std::make_shared<Embedding>(32, 64, 40, o);
  auto model = std::make_shared<Sequential>();
  model->push_back(emb);
  for (uint64_t i = 0; i < blocks; ++i) {
    model->push_back(std::make_shared<TransformerBlock>(64, 4, 0.1, 2, o));
  }
  model->push_back(std::make_shared<LayerNorm>(64, 1e-5, o));
  model->push_back(std::make_shared<TiedOutput>(emb));
  auto opt = std::make_unique<optim::Adam>(
      model->named_parameters(),
      optim::AdamOptions{.lr = 3e-3, .weight_decay = 0.1, .decoupled = true,
                         .decay_matrices_only = true});
  opt->set_schedule({.lr = 3e-3, .min_lr = 3e-4, .warmup = 2, .total = 8});
  return {model, std::move(opt), 32};
}

Trainee tiny_gpt(Device d) { return tiny_gpt_of(d, 2); }

// Blocks enough for the first inputs to leave the device during forward
// (host_offload.h: kOffloadReleaseAfterBlocks), and so come back in
// backward.
Trainee deeper_tiny_gpt(Device d) { return tiny_gpt_of(d, kOffloadReleaseAfterBlocks + 1); }

// deeper_tiny_gpt with its blocks recomputed whole in backward (the first
// in halves) and their inputs waiting in host memory meanwhile
// (host_offload.h): the copies out and back go on the copy stream,
// ordered with the step's kernels by events, which a capture records as
// the graph's edges. The same bits as deeper_tiny_gpt's.
Trainee tiny_gpt_offloading(Device d) {
  Trainee t = deeper_tiny_gpt(d);
  bool first = true;
  for (const auto& child : t.model->children()) {
    if (auto* block = dynamic_cast<TransformerBlock*>(child.get())) {
      block->set_recompute(first ? TransformerBlock::Recompute::BlockInHalves
                                 : TransformerBlock::Recompute::Block);
      block->set_offload(TransformerBlock::Offload::Inputs);
      first = false;
    }
  }
  return t;
}

Trainee small_cnn(Device d) {
  manual_seed(12);
  const TensorOptions o{DType::Float32, d};
  auto model = std::make_shared<Sequential>(std::vector<std::shared_ptr<Module>>{
      std::make_shared<Conv2d>(1, 6, 5, 1, 0, true, o), std::make_shared<ReLU>(),
      std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
      std::make_shared<Dropout>(0.25), std::make_shared<Linear>(6 * 12 * 12, 10, true, o)});
  auto opt = std::make_unique<optim::SGD>(model->named_parameters(),
                                          optim::SgdOptions{.lr = 0.05, .momentum = 0.9});
  return {model, std::move(opt), 10};
}

MakeBatch text_batches(Device d) {
  return [d](int64_t step, Tensor& x, Tensor& y) {
    std::mt19937_64 rng(100 + step);
    std::vector<int64_t> xs(16 * 40), ys(16 * 40);
    for (auto& v : xs) v = static_cast<int64_t>(rng() % 32);
    for (auto& v : ys) v = static_cast<int64_t>(rng() % 32);
    x = from_vector(xs, {16, 40}, d);
    y = from_vector(ys, {16, 40}, d);
  };
}

MakeBatch image_batches(Device d) {
  return [d](int64_t step, Tensor& x, Tensor& y) {
    std::mt19937_64 rng(200 + step);
    std::normal_distribution<float> n;
    std::vector<float> xs(32 * 28 * 28);
    std::vector<int64_t> ys(32);
    for (auto& v : xs) v = n(rng);
    for (auto& v : ys) v = static_cast<int64_t>(rng() % 10);
    x = from_vector(xs, {32, 1, 28, 28}, d);
    y = from_vector(ys, {32}, d);
  };
}

// One training step as the job runner takes it.
// `copies`: as the job's step, under autocast the weights' bfloat16 copies
// made once before the forward (otherwise each product converts its own).
Tensor train_step(Trainee& t, const Tensor& x, const Tensor& y, bool copies = true) {
  StepRandom random(77, t.opt->step_counter());
  t.opt->zero_grad();
  Tensor loss;
  {
    std::optional<AutocastWeights> weights;
    if (copies) weights.emplace(t.model->product_parameters());
    const Tensor logits = t.model->forward(x);
    if (weights) weights->release();
    loss = cross_entropy(logits.reshape({-1, t.classes}), y.reshape({-1}));
    loss.backward();
  }
  optim::clip_grad_norm(t.model->named_parameters(), 1.0);
  t.opt->step();
  return loss;
}

// `steps` training steps of `t` on `batch`, from its first, `before(step)`
// (may be empty) ahead of each; their losses, read by nobody yet. Stops at
// a fatal failure in `before`.
std::vector<Tensor> train_steps(Trainee& t, const MakeBatch& batch, int64_t steps,
                                const std::function<void(int64_t step)>& before = {}) {
  std::vector<Tensor> losses;
  for (int64_t step = 0; step < steps; ++step) {
    if (before) before(step);
    if (::testing::Test::HasFatalFailure()) break;
    Tensor x, y;
    batch(step, x, y);
    losses.push_back(train_step(t, x, y));
  }
  return losses;
}

// The first `count` of `losses` are the bits of `expected`'s.
void expect_same_losses(const std::vector<Tensor>& losses, const std::vector<Tensor>& expected,
                        size_t count) {
  ASSERT_GE(losses.size(), count);
  ASSERT_GE(expected.size(), count);
  for (size_t step = 0; step < count; ++step) {
    EXPECT_EQ(losses[step].to_vector<float>(), expected[step].to_vector<float>())
        << "loss of step " << step;
  }
}

std::vector<std::vector<float>> weights(const Trainee& t) {
  std::vector<std::vector<float>> out;
  for (const auto& p : t.model->parameters()) out.push_back(p.to_vector<float>());
  return out;
}

// Trains two copies: one op by op, its products converting their own
// weights, and one through a StepGraph (after a first step op by op, as
// the job runner does: what a step makes once, the optimizer's state, is
// made outside the graph's memory) with the step's weight copies, and compares every
// step's loss and weights bit for bit. `make_graphed`: the graphed copy's
// maker, when not `make`.
void expect_replays_match(Device gpu, const MakeTrainee& make, const MakeBatch& batch,
                          const MakeTrainee& make_graphed = {}) {
  DeferredLabelCheck labels(gpu);  // (cross_entropy would read its check back)
  Trainee eager = make(gpu), graphed = (make_graphed ? make_graphed : make)(gpu);
  Tensor gx, gy, graph_loss;
  std::optional<StepGraph> graph;
  constexpr int kSteps = 7;
  for (int64_t step = 0; step < kSteps; ++step) {
    Tensor x, y;
    batch(step, x, y);
    const Tensor expected = train_step(eager, x, y, /*copies=*/false);
    Tensor got;
    if (step == 0) {
      got = train_step(graphed, x, y);
      gx = empty(x.sizes(), x.options());
      gy = empty(y.sizes(), y.options());
      // (What the trace leaves, with no memory behind it, goes: the job
      // drops its gradients and loss the same way.)
      graph.emplace(gpu, [&] { graph_loss = train_step(graphed, gx, gy); },
                    [&] {
                      graph_loss = Tensor();
                      graphed.opt->zero_grad();
                    });
    } else {
      gx.copy_(x);
      gy.copy_(y);
      ASSERT_TRUE(graph->run()) << graph->why_not();
      got = graph_loss;
    }
    EXPECT_EQ(got.to_vector<float>(), expected.to_vector<float>()) << "loss of step " << step;
    ASSERT_EQ(weights(graphed), weights(eager)) << "weights after step " << step;
  }
  EXPECT_TRUE(graph->replaying());
  EXPECT_EQ(graph->launches(), kSteps - 1) << "traced and captured at its first run, launched at each";
  EXPECT_GT(graph->pool_bytes(), 0u);
  EXPECT_EQ(graphed.opt->steps(), kSteps);

  // Replays queue work and return: the host waits for nothing.
  Tensor x, y;
  batch(kSteps, x, y);
  const uint64_t waits = host_waits();
  for (int i = 0; i < 3; ++i) {
    gx.copy_(x);
    gy.copy_(y);
    ASSERT_TRUE(graph->run());
  }
  EXPECT_EQ(host_waits(), waits);
  labels.check();
}

TEST_F(CudaGraphTest, AGptStepReplaysBitForBitAsOpByOp) {
  expect_replays_match(gpu, tiny_gpt, text_batches(gpu));
}

TEST_F(CudaGraphTest, AGptStepUnderBf16AutocastReplaysBitForBit) {
  AutocastGuard autocast(DType::BFloat16);
  expect_replays_match(gpu, tiny_gpt, text_batches(gpu));
}

TEST_F(CudaGraphTest, AGptStepWithItsBlocksInputsInHostMemoryReplaysBitForBit) {
  AutocastGuard autocast(DType::BFloat16);
  const uint64_t pinned_before = pinned_host_allocator()->stats().allocations;
  expect_replays_match(gpu, deeper_tiny_gpt, text_batches(gpu), tiny_gpt_offloading);
  // (Each block's slot took page-locked memory once, at its first step;
  // the steps after, op by op and replayed, reused it.)
  EXPECT_EQ(pinned_host_allocator()->stats().allocations - pinned_before,
            kOffloadReleaseAfterBlocks + 1);
}

// Adam's state in host memory (Optimizer::move_state_to_host), read and
// written there by the update kernels over the host link: the steps, op by
// op and replayed from a graph, give the bits of the state kept on the
// device; the state moves once, midway (what it held comes along), and
// reads back from the host.
TEST_F(CudaGraphTest, AdamsStateInHostMemoryGivesTheSameSteps) {
  Trainee on_device = tiny_gpt(gpu);
  MakeBatch batch = text_batches(gpu);
  DeferredLabelCheck labels(gpu);
  const std::vector<Tensor> expected = train_steps(on_device, batch, 4);
  Trainee moved = tiny_gpt(gpu);
  const std::vector<Tensor> losses = train_steps(moved, batch, 4, [&](int64_t step) {
    if (step != 2) return;
    ASSERT_TRUE(moved.opt->move_state_to_host());
    EXPECT_FALSE(moved.opt->move_state_to_host()) << "once";
  });
  ASSERT_FALSE(HasFatalFailure());
  // Read as the last step's update is queued (nothing else waited for the
  // device since; the losses are read after): state() waits for it. Page-locked host memory, the
  // moments of the state kept on the device.
  const auto host_state = moved.opt->state();
  std::vector<std::vector<float>> host_values;
  for (const auto& [name, t] : host_state) {
    if (name != "adam.step") host_values.push_back(t.to_vector<float>());
  }
  const auto device_state = on_device.opt->state();
  ASSERT_EQ(device_state.size(), host_state.size());
  for (size_t i = 1, k = 0; i < host_state.size(); ++i, ++k) {  // (0: the step count)
    SCOPED_TRACE(host_state[i].first);
    EXPECT_FALSE(host_state[i].second.device().is_cuda());
#ifdef LEASEHOLD_HAVE_CUDA
    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, host_state[i].second.raw_data()),
              cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
#endif
    EXPECT_EQ(host_values[k], device_state[i].second.to_vector<float>());
  }
  expect_same_losses(losses, expected, 3);
  EXPECT_EQ(weights(moved), weights(on_device));
  labels.check();
  // From the first step on, and as a CUDA graph.
  expect_replays_match(gpu, [](Device d) {
    Trainee t = tiny_gpt(d);
    EXPECT_TRUE(t.opt->move_state_to_host());
    return t;
  }, batch);
}

// Part of Adam's state in host memory (move_state_to_host with a number of
// bytes): whole parameters' state, in order, until at least that much
// moved; the steps give the bits of the state kept on the device, op by op
// and replayed from a graph; the state moves on in later parts until all
// of it is there, and then nothing more moves.
TEST_F(CudaGraphTest, PartOfAdamsStateInHostMemoryGivesTheSameSteps) {
  Trainee on_device = tiny_gpt(gpu);
  MakeBatch batch = text_batches(gpu);
  DeferredLabelCheck labels(gpu);
  const std::vector<Tensor> expected = train_steps(on_device, batch, 4);
  Trainee moved = tiny_gpt(gpu);
  const uint64_t total = moved.opt->gpu_parameters_state_bytes();
  ASSERT_GT(total, 0u);
  EXPECT_EQ(moved.opt->host_state_bytes(), 0u);
  uint64_t first_part = 0;
  const std::vector<Tensor> losses = train_steps(moved, batch, 4, [&](int64_t step) {
    if (step == 1) {
      ASSERT_TRUE(moved.opt->move_state_to_host(1));
      first_part = moved.opt->host_state_bytes();
      EXPECT_GT(first_part, 0u) << "one parameter's state, whole";
      EXPECT_LT(first_part, total);
    }
    if (step == 2) {
      ASSERT_TRUE(moved.opt->move_state_to_host(total / 3));
      EXPECT_GE(moved.opt->host_state_bytes(), first_part + total / 3);
      EXPECT_LT(moved.opt->host_state_bytes(), total);
    }
  });
  ASSERT_FALSE(HasFatalFailure());
  expect_same_losses(losses, expected, 3);
  // Some moments in host memory, the others on the device, the values of
  // the state kept on the device.
  const auto part_state = moved.opt->state();
  const auto device_state = on_device.opt->state();
  ASSERT_EQ(part_state.size(), device_state.size());
  int on_host = 0, on_gpu = 0;
  for (size_t i = 1; i < part_state.size(); ++i) {  // (0: the step count)
    SCOPED_TRACE(part_state[i].first);
    (part_state[i].second.device().is_cuda() ? on_gpu : on_host) += 1;
    EXPECT_EQ(part_state[i].second.to_vector<float>(), device_state[i].second.to_vector<float>());
  }
  EXPECT_GT(on_host, 0);
  EXPECT_GT(on_gpu, 0);
  EXPECT_EQ(weights(moved), weights(on_device));
  ASSERT_TRUE(moved.opt->move_state_to_host());
  EXPECT_EQ(moved.opt->host_state_bytes(), total);
  EXPECT_FALSE(moved.opt->move_state_to_host(1)) << "all of it is there";
  labels.check();
  // From the first step on, and as a CUDA graph.
  expect_replays_match(gpu, [](Device d) {
    Trainee t = tiny_gpt(d);
    EXPECT_TRUE(t.opt->move_state_to_host(t.opt->gpu_parameters_state_bytes() / 2));
    return t;
  }, batch);
}

// Page-locked host memory up to a limit, counted: a job's host tier
// (agent/spill/host_tier.h), as its PinnedHostGuard installs it.
class LimitedPinned final : public Allocator {
 public:
  explicit LimitedPinned(uint64_t limit) : limit_(limit) {}
  void* allocate(size_t bytes) override {
    std::lock_guard lock(mu_);
    if (in_use_ + bytes > limit_) {
      throw OutOfMemoryError("no room for " + std::to_string(bytes) + " bytes", bytes);
    }
    void* p = inner_->allocate(bytes);
    in_use_ += bytes;
    return p;
  }
  void deallocate(void* p, size_t bytes) noexcept override {
    inner_->deallocate(p, bytes);
    std::lock_guard lock(mu_);
    in_use_ -= bytes;
  }
  Device device() const override { return Device::cpu(); }
  AllocatorStats stats() const override {
    std::lock_guard lock(mu_);
    AllocatorStats s;
    s.in_use_bytes = in_use_;
    return s;
  }

 private:
  std::shared_ptr<Allocator> inner_ = pinned_host_allocator();  // (cudaHostAlloc's: no guard yet)
  uint64_t limit_;
  mutable std::mutex mu_;
  uint64_t in_use_ = 0;
};

// Adam's state in host memory comes from this thread's page-locked memory
// (a job's host tier): a move it has no room for moves nothing and keeps
// the state where it was; one it has room for takes its bytes there,
// state not made yet (before the first step) made now, zero. The steps
// give the bits of the state kept on the device either way.
TEST_F(CudaGraphTest, AdamsStateInHostMemoryComesFromTheThreadsPageLockedMemory) {
  Trainee on_device = tiny_gpt(gpu);
  MakeBatch batch = text_batches(gpu);
  DeferredLabelCheck labels(gpu);
  const std::vector<Tensor> expected = train_steps(on_device, batch, 3);
  Trainee moved = tiny_gpt(gpu);
  const uint64_t total = moved.opt->gpu_parameters_state_bytes();
  auto tier = std::make_shared<LimitedPinned>(total / 2);
  {
    PinnedHostGuard guard(tier);
    EXPECT_EQ(pinned_host_allocator(), tier);
    EXPECT_FALSE(moved.opt->move_state_to_host(total)) << "all of it: no room";
    EXPECT_EQ(moved.opt->host_state_bytes(), 0u);
    EXPECT_EQ(tier->stats().in_use_bytes, 0u);
    ASSERT_TRUE(moved.opt->move_state_to_host(1));
    EXPECT_GT(moved.opt->host_state_bytes(), 0u);
    EXPECT_GE(tier->stats().in_use_bytes, moved.opt->host_state_bytes());
  }
  EXPECT_NE(pinned_host_allocator(), tier);
  expect_same_losses(train_steps(moved, batch, 3), expected, 3);
  EXPECT_EQ(weights(moved), weights(on_device));
  labels.check();
}

TEST_F(CudaGraphTest, ACnnStepWithMomentumReplaysBitForBit) {
  expect_replays_match(gpu, small_cnn, image_batches(gpu));
}

// A step that reads a value back cannot be captured: run() says so, runs
// nothing (its trace is a capture, whose work never runs), and the
// caller's step op by op is the step as it would be.
TEST_F(CudaGraphTest, AStepThatWaitsForTheHostRunsOpByOpUnchanged) {
  DeferredLabelCheck labels(gpu);
  Trainee a = small_cnn(gpu), b = small_cnn(gpu);
  MakeBatch batch = image_batches(gpu);
  Tensor x, y;
  batch(0, x, y);
  train_step(a, x, y);
  train_step(b, x, y);  // (as a job's first step: its optimizer's state made)
  double read_back = 0;
  StepGraph graph(gpu, [&] { read_back = train_step(b, x, y).item(); },
                  [&] { b.opt->zero_grad(); });
  EXPECT_FALSE(graph.run()) << "the trace fails";
  EXPECT_EQ(read_back, 0) << "nothing was read";
  EXPECT_FALSE(graph.replaying());
  EXPECT_NE(graph.why_not().find("tracing"), std::string::npos) << graph.why_not();
  EXPECT_FALSE(graph.ran_out_of_memory());
  EXPECT_EQ(graph.pool_bytes(), 0u);
  EXPECT_EQ(weights(a), weights(b)) << "the failed trace changed nothing";
  EXPECT_EQ(b.opt->steps(), 1);
  EXPECT_FALSE(graph.run()) << "and it is not tried again";
  // The device is usable: the next step op by op matches.
  train_step(a, x, y);
  train_step(b, x, y);
  EXPECT_EQ(weights(a), weights(b));
  labels.check();
}

// A traced step that keeps one of its tensors past the trace (here its
// loss: no after_trace drops it) would hold an address with no memory
// behind it: run() says which, rather than leave it to be read.
TEST_F(CudaGraphTest, ATracedTensorKeptPastTheTraceIsAnError) {
  DeferredLabelCheck labels(gpu);
  Trainee t = small_cnn(gpu);
  MakeBatch batch = image_batches(gpu);
  Tensor x, y, kept;
  batch(0, x, y);
  train_step(t, x, y);
  StepGraph graph(gpu, [&] { kept = train_step(t, x, y); }, [&] { t.opt->zero_grad(); });
  try {
    graph.run();
    ADD_FAILURE() << "no error";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("left 1 tensors alive past its trace"),
              std::string::npos)
        << e.what();
  }
  kept = Tensor();
  labels.check();
}

}  // namespace
}  // namespace leasehold::engine
