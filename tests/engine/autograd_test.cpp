// Autograd semantics a user relies on.
#include <gtest/gtest.h>

#include <any>
#include <cmath>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"
#include "tests/engine/counting_allocator.h"

namespace leasehold::engine {
namespace {

TEST(Autograd, ChainRuleAndAccumulation) {
  Tensor x = from_vector<float>({1, 2, 3}, {3});
  x.set_requires_grad(true);
  Tensor y = sum(mul(x, x));  // dy/dx = 2x
  y.backward(Tensor(), /*retain_graph=*/true);
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 4, 6}));
  y.backward();  // accumulates
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{4, 8, 12}));
}

// y = 2x recorded by a node that may take x's gradient so far into its own
// (Node::fold_into_input0).
struct DoublingNode final : Node {
  bool takes = false;
  Tensor offered;
  const char* name() const override { return "DoublingNode"; }
  bool fold_into_input0(const Tensor& sum_so_far) override {
    offered = sum_so_far;
    return takes;
  }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor own = mul(g, 2.0);
    return {takes && offered.defined() ? add(own, offered) : own};
  }
};

// x + 2x: the addition's gradient for x arrives first and is offered to the
// node; taken, the node's gradient replaces the sum (not added to it again);
// declined, the engine adds the two. x's gradient is 3 either way.
TEST(Autograd, ANodeMayTakeItsInputsGradientSoFar) {
  // x, and y = 2x recorded by a DoublingNode that takes or declines.
  struct Doubled {
    Tensor x, y;
    std::shared_ptr<DoublingNode> node = std::make_shared<DoublingNode>();
    explicit Doubled(bool takes) : x(from_vector<float>({1, -2}, {2})) {
      x.set_requires_grad(true);
      y = mul(x.detach(), 2.0);
      node->takes = takes;
      record(y, node, {&x});
    }
  };
  for (bool takes : {true, false}) {
    SCOPED_TRACE(takes ? "taken" : "declined");
    Doubled d(takes);
    add(d.x, d.y).backward(ones({2}));
    ASSERT_TRUE(d.node->offered.defined());
    EXPECT_EQ(d.node->offered.to_vector<float>(), (std::vector<float>{1, 1}));
    EXPECT_EQ(d.x.grad().to_vector<float>(), (std::vector<float>{3, 3}));
  }
  // Nothing to offer: x reaches the node alone.
  Doubled d(true);
  d.y.backward(ones({2}));
  EXPECT_FALSE(d.node->offered.defined());
  EXPECT_EQ(d.x.grad().to_vector<float>(), (std::vector<float>{2, 2}));
}

// y = 2x recorded by a node that doubles its gradient in place when the
// engine says it is the node's alone (Node::grad_output_owned).
struct InPlaceDoublingNode final : Node {
  std::vector<bool> owned;  // per apply
  const char* name() const override { return "InPlaceDoublingNode"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    owned.push_back(grad_output_owned);
    if (!grad_output_owned) return {mul(g, 2.0)};
    float* v = g.data<float>();
    for (int64_t i = 0; i < g.numel(); ++i) v[i] *= 2;
    return {g};
  }
};

// A gradient that another node or the caller still holds is never offered
// for writing over: the addition (its own gradient fresh from the product
// after it) hands one tensor to both its inputs, and a gradient passed to
// backward stays the caller's. Written over wrongly, the second node's
// input would be doubled twice, or the caller's changed.
TEST(Autograd, ANodeMayWriteOverOnlyAGradientThatIsItsAlone) {
  auto doubled = [](Tensor& x, std::shared_ptr<InPlaceDoublingNode>& node) {
    x = from_vector<float>({1, -2}, {2});
    x.set_requires_grad(true);
    Tensor y = mul(x.detach(), 2.0);
    node = std::make_shared<InPlaceDoublingNode>();
    record(y, node, {&x});
    return y;
  };
  Tensor a, b;
  std::shared_ptr<InPlaceDoublingNode> na, nb;
  mul(add(doubled(a, na), doubled(b, nb)), 3.0).backward(ones({2}));
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{6, 6}));
  EXPECT_EQ(b.grad().to_vector<float>(), (std::vector<float>{6, 6}));
  ASSERT_EQ(na->owned.size(), 1u);
  ASSERT_EQ(nb->owned.size(), 1u);
  EXPECT_FALSE(na->owned[0] && nb->owned[0]) << "one tensor went to both";
  EXPECT_TRUE(na->owned[0] || nb->owned[0]) << "the second, once the first let go of it";

  // A gradient made for the node alone (the product's): its own.
  Tensor c;
  std::shared_ptr<InPlaceDoublingNode> nc;
  mul(doubled(c, nc), 3.0).backward(ones({2}));
  EXPECT_EQ(c.grad().to_vector<float>(), (std::vector<float>{6, 6}));
  ASSERT_EQ(nc->owned.size(), 1u);
  EXPECT_TRUE(nc->owned[0]);

  // The root's gradient, which the caller holds: not its own.
  Tensor d;
  std::shared_ptr<InPlaceDoublingNode> nd;
  Tensor root = ones({2});
  doubled(d, nd).backward(root);
  EXPECT_EQ(root.to_vector<float>(), (std::vector<float>{1, 1}));
  EXPECT_EQ(d.grad().to_vector<float>(), (std::vector<float>{2, 2}));
  EXPECT_FALSE(nd->owned.at(0));
}

// Saved tensors held as they are behind the hooks, as a spill manager's
// handle holds one.
class HoldingHooks final : public SavedTensorHooks {
 public:
  std::any pack(const Tensor& t) override { return t; }
  Tensor unpack(const std::any& packed) override { return std::any_cast<Tensor>(packed); }
};

// A product's backward makes its weight's gradient first and lets go of
// its input, which nothing else holds (the hooks' handle included),
// before it makes the input's gradient of the same size (one of the two
// at a time at backward's peak), unless the graph is retained; the
// gradients are the same. An input the caller still holds keeps its
// values.
TEST(Autograd, AProductLetsItsInputGoBeforeMakingItsGradient) {
  // At each allocation of the input's size made in a LinearBackward:
  // whether the input (`watched`) was still allocated.
  auto watching = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
  void* watched = nullptr;
  size_t watched_bytes = 0;
  std::vector<bool> watched_live_then;
  watching->on_allocate = [&](size_t bytes) {
    if (bytes == watched_bytes && std::string(backward_node_running()) == "LinearBackward") {
      watched_live_then.push_back(watched != nullptr);
    }
  };
  watching->on_free = [&](void* ptr, size_t) {
    if (ptr == watched) watched = nullptr;
  };
  AllocatorGuard guard(watching);
  Tensor x = rand({64, 32}), w = rand({3, 32});
  x.set_requires_grad(true);
  w.set_requires_grad(true);
  const size_t input_bytes = 64 * 32 * sizeof(float);
  for (int run = 0; run < 4; ++run) {
    const bool retain = run % 2 == 1, hooked = run >= 2;
    SCOPED_TRACE(std::string(retain ? "retained" : "not retained") +
                 (hooked ? ", saved through hooks" : ""));
    std::optional<SavedTensorHooksGuard> hooks;
    if (hooked) hooks.emplace(std::make_shared<HoldingHooks>());
    x.set_grad(Tensor());
    w.set_grad(Tensor());
    watched_live_then.clear();
    Tensor loss;
    {
      Tensor h = mul(x, 2.0);  // the product's input, kept by its backward alone
      watched = h.data<float>(), watched_bytes = input_bytes;
      loss = sum(linear(h, w, Tensor()));
    }
    loss.backward(Tensor(), retain);
    EXPECT_EQ(watched_live_then, std::vector<bool>{retain});
    // d(sum(2x wᵀ))/dx = 2 Σ_o w[o, :] on every row; /dw = 2 Σ_n x[n, :].
    const std::vector<float> xs = x.to_vector<float>(), ws = w.to_vector<float>();
    const std::vector<float> gx = x.grad().to_vector<float>(), gw = w.grad().to_vector<float>();
    for (int64_t n = 0; n < 64; ++n) {
      for (int64_t i = 0; i < 32; ++i) {
        const float want = 2 * (ws[i] + ws[32 + i] + ws[64 + i]);
        ASSERT_NEAR(gx[n * 32 + i], want, 1e-5) << n << ", " << i;
      }
    }
    for (int64_t i = 0; i < 32; ++i) {
      float want = 0;
      for (int64_t n = 0; n < 64; ++n) want += 2 * xs[n * 32 + i];
      for (int64_t o = 0; o < 3; ++o) ASSERT_NEAR(gw[o * 32 + i], want, 1e-3) << o << ", " << i;
    }
    if (retain) {
      loss.backward();  // the input was kept for this one
      EXPECT_NEAR(w.grad().to_vector<float>()[0], 2 * gw[0], 1e-3);
    }
    watched = nullptr, watched_bytes = 0;
  }
  Tensor h = mul(x, 2.0);
  sum(linear(h, w, Tensor())).backward();
  const std::vector<float> xs = x.to_vector<float>(), hs = h.to_vector<float>();
  for (size_t i = 0; i < xs.size(); ++i) ASSERT_EQ(hs[i], 2 * xs[i]) << i;
}

// A product adds its weight's gradient to the weight's gradient so far in
// place (gradient_to_add_into) where it is the backward's only part for
// the weight and the leaf alone holds that sum: no tensor of the weight's
// size is made. Where another part comes in the same backward (the weight
// used twice), or something else holds the sum, the sum is made anew; the
// values are the sums either way.
TEST(Autograd, AProductAddsItsWeightsGradientToASumSoFarOfTheLeafsAlone) {
  manual_seed(41);
  const size_t w_bytes = 3 * 32 * sizeof(float);
  auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
  int made = 0;  // of the weight's size, during a backward
  counting->on_allocate = [&](size_t bytes) { made += bytes == w_bytes && in_backward(); };
  AllocatorGuard counted(counting);
  const Tensor x1 = rand({64, 32}), x2 = rand({64, 32}), x3 = rand({64, 32});
  Tensor w = rand({3, 32}).set_requires_grad(true);
  // Each input's part of the weight's gradient, alone.
  auto part = [&](const Tensor& x) {
    Tensor v = w.detach().set_requires_grad(true);
    sum(linear(x, v, Tensor())).backward();
    return v.grad();
  };
  const Tensor g1 = part(x1), g2 = part(x2), g3 = part(x3);
  auto near = [](const Tensor& got, const Tensor& want) {
    const std::vector<float> a = got.to_vector<float>(), b = want.to_vector<float>();
    for (size_t i = 0; i < a.size(); ++i) {
      if (std::abs(a[i] - b[i]) > 1e-4f * (1 + std::abs(b[i]))) return false;
    }
    return true;
  };

  sum(linear(x1, w, Tensor())).backward();
  void* sum_memory = w.grad().raw_data();
  made = 0;
  sum(linear(x2, w, Tensor())).backward();
  EXPECT_EQ(made, 0) << "the part made apart and added after";
  EXPECT_EQ(w.grad().raw_data(), sum_memory);
  EXPECT_TRUE(near(w.grad(), add(g1, g2)));

  // Held elsewhere: the holder's tensor stays as it was.
  const Tensor held = w.grad();
  const std::vector<float> held_values = held.to_vector<float>();
  sum(linear(x3, w, Tensor())).backward();
  EXPECT_NE(w.grad().raw_data(), held.raw_data());
  EXPECT_EQ(held.to_vector<float>(), held_values);
  EXPECT_TRUE(near(w.grad(), add(add(g1, g2), g3)));

  // Two parts in one backward: each counted once.
  const Tensor before = w.grad().clone();
  sum(add(linear(x1, w, Tensor()), linear(x2, w, Tensor()))).backward();
  EXPECT_TRUE(near(w.grad(), add(before, add(g1, g2))));

  // The leaf's own gradient sent back to it is added like any other part
  // (only what a node summed in place is taken as summed).
  Tensor v = from_vector<float>({1, 2, 3}, {3}).set_requires_grad(true);
  v.backward(ones({3}));
  v.backward(v.grad());
  EXPECT_EQ(v.grad().to_vector<float>(), (std::vector<float>{2, 2, 2}));
}

TEST(Autograd, SharedSubexpressionGetsBothGradients) {
  Tensor x = from_vector<double>({0.5, -1.0}, {2}, Device::cpu());
  x.set_requires_grad(true);
  Tensor h = exp(x);
  Tensor y = sum(add(mul(h, h), h));  // d/dx = 2e^{2x} + e^x
  y.backward();
  auto g = x.grad().to_vector<double>();
  EXPECT_NEAR(g[0], 2 * std::exp(1.0) + std::exp(0.5), 1e-12);
  EXPECT_NEAR(g[1], 2 * std::exp(-2.0) + std::exp(-1.0), 1e-12);
}

TEST(Autograd, SecondBackwardThroughFreedGraphIsAnError) {
  Tensor x = ones({2}).set_requires_grad(true);
  Tensor y = sum(exp(x));
  y.backward();
  try {
    y.backward();
    FAIL() << "second backward through freed buffers succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("second time"), std::string::npos) << e.what();
  }
}

TEST(Autograd, NonScalarNeedsExplicitGradient) {
  Tensor x = ones({3}).set_requires_grad(true);
  Tensor y = mul(x, 2.0);
  EXPECT_THROW(y.backward(), std::invalid_argument);
  y.backward(from_vector<float>({1, 10, 100}, {3}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 20, 200}));
  EXPECT_THROW(y.backward(ones({4})), std::invalid_argument) << "gradient of the wrong shape";
}

TEST(Autograd, NoGradAndDetach) {
  Tensor x = ones({2}).set_requires_grad(true);
  {
    NoGradGuard guard;
    Tensor y = mul(x, 3.0);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(y.grad_fn(), nullptr);
  }
  Tensor d = mul(x, 3.0).detach();
  EXPECT_FALSE(d.requires_grad());
  EXPECT_THROW(sum(d).backward(), std::invalid_argument) << "nothing requires grad";
  Tensor z = sum(mul(x, d));  // d is a constant
  z.backward();
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{3, 3}));
}

TEST(Autograd, IntegerTensorsCannotRequireGrad) {
  Tensor i = from_vector<int64_t>({1, 2}, {2});
  EXPECT_THROW(i.set_requires_grad(true), std::invalid_argument);
}

// Saved tensors go through the hooks: pack copies them out (as a spill store
// would) and drops the original; unpack restores them.
class CopyOutHooks : public SavedTensorHooks {
 public:
  std::any pack(const Tensor& t) override {
    ++packed;
    return std::make_pair(t.sizes(), t.to(DType::Float64).to_vector<double>());
  }
  Tensor unpack(const std::any& packed_value) override {
    ++unpacked;
    auto& [shape, values] = std::any_cast<const std::pair<Shape, std::vector<double>>&>(
        packed_value);
    return from_vector(values, shape).to(DType::Float32);
  }
  int packed = 0, unpacked = 0;
};

TEST(Autograd, SavedTensorsRoundTripThroughHooks) {
  manual_seed(11);
  Tensor w = randn({4, 3}).set_requires_grad(true);
  Tensor x = randn({5, 4});
  auto run = [&] {
    w.set_grad(Tensor());
    Tensor loss = sum(tanh(matmul(x, w)));
    loss.backward();
    return w.grad().to_vector<float>();
  };
  auto plain = run();
  auto hooks = std::make_shared<CopyOutHooks>();
  std::vector<float> hooked;
  {
    SavedTensorHooksGuard guard(hooks);
    hooked = run();
  }
  EXPECT_GT(hooks->packed, 0);
  EXPECT_EQ(hooks->packed, hooks->unpacked);
  EXPECT_EQ(plain, hooked) << "gradients must not change when saved tensors leave and return";
}

// A leaf used twice in one graph (a weight tied to two layers) gets one
// summed gradient, reported ready once: a data-parallel job all-reduces it
// once.
TEST(Autograd, ALeafUsedTwiceAccumulatesOnce) {
  Tensor w = from_vector<double>({1.0, 2.0}, {2}).set_requires_grad(true);
  int ready = 0;
  {
    GradientReadyGuard hook([&](const Tensor& leaf) {
      ++ready;
      EXPECT_EQ(leaf.impl(), w.impl());
    });
    add(sum(mul(w, 3.0)), sum(mul(w, w))).backward();  // d/dw = 3 + 2w
  }
  EXPECT_EQ(ready, 1);
  EXPECT_EQ(w.grad().to_vector<double>(), (std::vector<double>{5.0, 7.0}));
  // A second graph over the same leaf, built while the first is alive,
  // backpropagates too (the accumulator keeps no tensors to free).
  Tensor a = sum(mul(w, 2.0)), b = sum(mul(w, 4.0));
  a.backward();
  b.backward();
  EXPECT_EQ(w.grad().to_vector<double>(), (std::vector<double>{11.0, 13.0}));
}

TEST(Autograd, ErrorsNameTheOperator) {
  try {
    add(ones({2, 3}), ones({4}));
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("add"), std::string::npos);
    EXPECT_NE(std::string(e.what()).find("[2, 3]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(matmul(ones({2, 3}), ones({4, 2})), std::invalid_argument);
  EXPECT_THROW(add(ones({2}), ones({2}, {DType::Float64})), std::invalid_argument);
  EXPECT_THROW(cross_entropy(ones({2, 3}), from_vector<int64_t>({0, 3}, {2})),
               std::invalid_argument)
      << "label 3 outside [0, 3)";
}

TEST(Tensor, ViewsShareStorage) {
  Tensor x = arange(12, {DType::Float32}).reshape({3, 4});
  Tensor t = x.transpose(0, 1);
  EXPECT_FALSE(t.is_contiguous());
  EXPECT_EQ(t.contiguous().to_vector<float>(),
            (std::vector<float>{0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11}));
  Tensor row = x.narrow(0, 1, 1);
  row.fill_(-1);
  EXPECT_EQ(x.to_vector<float>()[4], -1);
  EXPECT_EQ(x.to_vector<float>()[8], 8);
  Tensor col = x.narrow(1, 2, 1);  // non-contiguous view written through copy_
  col.copy_(full({3, 1}, 7));
  EXPECT_EQ(x.to_vector<float>()[2], 7);
  EXPECT_EQ(x.to_vector<float>()[10], 7);
  EXPECT_THROW(t.view({12}), std::invalid_argument);
  EXPECT_EQ(t.reshape({12}).numel(), 12);
}

}  // namespace
}  // namespace leasehold::engine

namespace leasehold::engine {
namespace {
TEST(Tensor, ValuesOfTensorsInAGraphCanBeRead) {
  Tensor p = ones({2}).set_requires_grad(true);
  Tensor y = mul(p, 3.0);
  EXPECT_EQ(p.to_vector<float>(), (std::vector<float>{1, 1}));
  EXPECT_EQ(y.to_vector<float>(), (std::vector<float>{3, 3}));
  EXPECT_EQ(sum(y).item(), 6);
}
}  // namespace
}  // namespace leasehold::engine
