#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/optim.h"
#include "kernels/elementwise.h"
#include "tests/engine/counting_allocator.h"

namespace leasehold::engine {
namespace {

using namespace nn;

// rand() fills uniformly in [low, high), reproducibly from the seed.
TEST(Random, RandIsUniformAndReproducible) {
  for (auto [lo, hi] : {std::pair{0.0, 1.0}, std::pair{-0.0357, 0.0357}, std::pair{-3.0, 5.5}}) {
    manual_seed(42);
    auto a = rand({200001}, {DType::Float64}, lo, hi).to_vector<double>();
    manual_seed(42);
    auto b = rand({200001}, {DType::Float64}, lo, hi).to_vector<double>();
    EXPECT_EQ(a, b);
    double mean = 0;
    for (double x : a) {
      ASSERT_GE(x, lo);
      ASSERT_LE(x, hi);
      mean += x / static_cast<double>(a.size());
    }
    EXPECT_NEAR(mean, (lo + hi) / 2, (hi - lo) * 0.005);
    // float32 holds the float64 draws rounded.
    manual_seed(42);
    auto f = rand({200001}, {}, lo, hi).to_vector<float>();
    for (size_t i = 0; i < f.size(); i += 997) ASSERT_EQ(f[i], static_cast<float>(a[i])) << i;
  }
}

// Two interleaved spirals: not linearly separable, so reaching 100% needs
// the hidden layers to work, and the optimiser to drive them.
void spirals(int64_t per_class, Tensor& x, Tensor& y) {
  std::vector<float> pts;
  std::vector<int64_t> labels;
  for (int c = 0; c < 2; ++c) {
    for (int64_t i = 0; i < per_class; ++i) {
      double r = 0.2 + 0.8 * double(i) / per_class;
      double t = 3.0 * double(i) / per_class * 3.14159 + c * 3.14159;
      pts.push_back(float(r * std::cos(t)));
      pts.push_back(float(r * std::sin(t)));
      labels.push_back(c);
    }
  }
  x = from_vector(pts, {2 * per_class, 2});
  y = from_vector(labels, {2 * per_class});
}

double accuracy(Module& m, const Tensor& x, const Tensor& y) {
  NoGradGuard ng;
  Tensor pred = argmax(m(x), 1);
  return sum(eq(pred, y)).item() / double(y.numel());
}

TEST(Training, TinyMlpReachesFullTrainingAccuracy) {
  manual_seed(42);
  Tensor x, y;
  spirals(100, x, y);
  Sequential model({std::make_shared<Linear>(2, 64), std::make_shared<ReLU>(),
                    std::make_shared<Linear>(64, 64), std::make_shared<ReLU>(),
                    std::make_shared<Linear>(64, 2)});
  optim::Adam opt(model.named_parameters(), {.lr = 0.01});
  auto t0 = std::chrono::steady_clock::now();
  double acc = 0;
  for (int step = 0; step < 2000 && acc < 1.0; ++step) {
    opt.zero_grad();
    Tensor loss = cross_entropy(model(x), y);
    loss.backward();
    opt.step();
    if (step % 50 == 49) acc = accuracy(model, x, y);
  }
  EXPECT_EQ(acc, 1.0) << "training accuracy on the spirals";
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(30));
}

TEST(Modules, ParametersAreNamedAndInitialisedLikePyTorch) {
  manual_seed(1);
  Sequential model({std::make_shared<Conv2d>(1, 6, 5, 1, 2), std::make_shared<ReLU>(),
                    std::make_shared<MaxPool2d>(2), std::make_shared<Flatten>(),
                    std::make_shared<Linear>(6 * 14 * 14, 10)});
  auto named = model.named_parameters();
  ASSERT_EQ(named.size(), 4u);
  EXPECT_EQ(named[0].first, "0.weight");
  EXPECT_EQ(named[1].first, "0.bias");
  EXPECT_EQ(named[2].first, "4.weight");
  EXPECT_EQ(named[3].first, "4.bias");
  EXPECT_EQ(model.parameter_count(), 6 * 25 + 6 + 6 * 14 * 14 * 10 + 10);
  // U(-1/sqrt(fan_in), 1/sqrt(fan_in))
  auto w = named[2].second.to_vector<float>();
  float bound = 1.0f / std::sqrt(float(6 * 14 * 14));
  float lo = *std::min_element(w.begin(), w.end()), hi = *std::max_element(w.begin(), w.end());
  EXPECT_GE(lo, -bound);
  EXPECT_LE(hi, bound);
  EXPECT_LT(lo, -0.9f * bound) << "the whole range is used";
  Tensor out = model(randn({3, 1, 28, 28}));
  EXPECT_EQ(out.sizes(), (Shape{3, 10}));
  EXPECT_THROW(model(randn({3, 2, 28, 28})), std::invalid_argument) << "wrong channels";
}

TEST(Modules, DropoutOnlyInTraining) {
  manual_seed(3);
  Dropout d(0.5);
  Tensor x = ones({1000});
  double kept = sum(d(x)).item();
  EXPECT_NEAR(kept, 1000, 150) << "scaled by 1/(1-p) so the expectation is unchanged";
  EXPECT_LT(sum(eq(d(x), zeros({1000}))).item(), 650);
  EXPECT_GT(sum(eq(d(x), zeros({1000}))).item(), 350);
  d.eval();
  EXPECT_EQ(sum(d(x)).item(), 1000);
}

// One parameter, known gradients: compare against the update rules written
// out in double.
TEST(Optim, SgdWithMomentumAndWeightDecayMatchesTheFormula) {
  Tensor p = from_vector<double>({1.0, -2.0}, {2}).set_requires_grad(true);
  optim::SGD opt({{"p", p}}, {.lr = 0.1, .momentum = 0.9, .weight_decay = 0.01});
  double ref[2] = {1.0, -2.0}, buf[2] = {0, 0};
  for (int step = 0; step < 3; ++step) {
    opt.zero_grad();
    sum(mul(mul(p, p), 0.5)).backward();  // grad = p
    opt.step();
    for (int i = 0; i < 2; ++i) {
      double d = ref[i] + 0.01 * ref[i];
      buf[i] = step == 0 ? d : 0.9 * buf[i] + d;
      ref[i] -= 0.1 * buf[i];
    }
  }
  auto got = p.to_vector<double>();
  EXPECT_NEAR(got[0], ref[0], 1e-12);
  EXPECT_NEAR(got[1], ref[1], 1e-12);
}

TEST(Optim, AdamMatchesTheFormulaAndRestoresState) {
  Tensor p = from_vector<double>({0.5, -1.5, 3.0}, {3}).set_requires_grad(true);
  optim::AdamOptions o{.lr = 0.01, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0};
  optim::Adam opt({{"p", p}}, o);
  double ref[3] = {0.5, -1.5, 3.0}, m[3] = {}, v[3] = {};
  for (int t = 1; t <= 4; ++t) {
    opt.zero_grad();
    sum(pow(p, 2.0)).backward();  // grad = 2p
    opt.step();
    for (int i = 0; i < 3; ++i) {
      double g = 2 * ref[i];
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.999 * v[i] + 0.001 * g * g;
      double mh = m[i] / (1 - std::pow(0.9, t)), vh = v[i] / (1 - std::pow(0.999, t));
      ref[i] -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
    }
  }
  auto got = p.to_vector<double>();
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(got[i], ref[i], 1e-10);

  // State round trip: a second optimiser restored from the first continues
  // exactly as the first would.
  Tensor q = p.detach().clone().set_requires_grad(true);
  optim::Adam resumed({{"p", q}}, o);
  resumed.load_state(opt.state());
  EXPECT_EQ(resumed.steps(), 4);
  opt.zero_grad();
  sum(pow(p, 2.0)).backward();
  opt.step();
  resumed.zero_grad();
  sum(pow(q, 2.0)).backward();
  resumed.step();
  EXPECT_EQ(p.to_vector<double>(), q.to_vector<double>());

  // A state with one bad moment changes nothing: neither the step count
  // nor a moment checked before it. Loaded, the moments go into the ones
  // the optimizer made, where they are.
  Tensor r = p.detach().clone().set_requires_grad(true);
  Tensor s = ones({2}, {DType::Float64}).set_requires_grad(true);
  optim::Adam other({{"p", r}, {"s", s}}, o);
  nn::NamedTensors bad = opt.state();
  bad.emplace_back("adam.m.s", ones({2}, {DType::Float64}));
  bad.emplace_back("adam.v.s", ones({3}, {DType::Float64}));
  const nn::NamedTensors before = other.state();
  EXPECT_THROW(other.load_state(bad), std::invalid_argument);
  EXPECT_EQ(other.steps(), 0);
  for (const auto& [name, t] : other.state()) {
    if (name == "adam.step") continue;
    EXPECT_EQ(t.to_vector<double>(), std::vector<double>(t.numel(), 0.0)) << name;
  }
  void* m_memory = nullptr;
  for (const auto& [name, t] : before) {
    if (name == "adam.m.p") m_memory = t.raw_data();
  }
  nn::NamedTensors good = opt.state();
  good.emplace_back("adam.m.s", ones({2}, {DType::Float64}));
  good.emplace_back("adam.v.s", ones({2}, {DType::Float64}));
  other.load_state(good);
  EXPECT_EQ(other.steps(), opt.steps());
  for (const auto& [name, t] : other.state()) {
    if (name == "adam.m.p") {
      EXPECT_EQ(t.raw_data(), m_memory) << "new moments made";
    }
  }
}

TEST(Optim, AdamWDecaysMatricesOnlyAndMatchesTheFormula) {
  // A matrix decays (AdamW: p *= 1 - lr·wd before the Adam update); a vector
  // does not when decay_matrices_only.
  Tensor w = from_vector<double>({0.5, -1.5, 3.0, 2.0}, {2, 2}).set_requires_grad(true);
  Tensor b = from_vector<double>({1.0, -1.0}, {2}).set_requires_grad(true);
  optim::AdamOptions o{.lr = 0.01, .weight_decay = 0.1, .decoupled = true,
                       .decay_matrices_only = true};
  optim::Adam opt({{"w", w}, {"b", b}}, o);
  std::vector<double> rw = {0.5, -1.5, 3.0, 2.0}, rb = {1.0, -1.0};
  std::vector<double> mw(4), vw(4), mb(2), vb(2);
  auto update = [](std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
                   double wd, int t) {
    for (size_t i = 0; i < p.size(); ++i) {
      double g = 2 * p[i];
      p[i] *= 1 - 0.01 * wd;
      m[i] = 0.9 * m[i] + 0.1 * g;
      v[i] = 0.999 * v[i] + 0.001 * g * g;
      double mh = m[i] / (1 - std::pow(0.9, t)), vh = v[i] / (1 - std::pow(0.999, t));
      p[i] -= 0.01 * mh / (std::sqrt(vh) + 1e-8);
    }
  };
  for (int t = 1; t <= 3; ++t) {
    opt.zero_grad();
    add(sum(pow(w, 2.0)), sum(pow(b, 2.0))).backward();
    opt.step();
    update(rw, mw, vw, 0.1, t);
    update(rb, mb, vb, 0.0, t);
  }
  auto gw = w.to_vector<double>(), gb = b.to_vector<double>();
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(gw[i], rw[i], 1e-12);
  for (int i = 0; i < 2; ++i) EXPECT_NEAR(gb[i], rb[i], 1e-12);
}

TEST(Optim, ClipGradNormScalesOnlyWhenOverTheLimit) {
  Tensor a = from_vector<double>({3.0, 0.0}, {2}).set_requires_grad(true);
  Tensor b = from_vector<double>({0.0, 4.0}, {1, 2}).set_requires_grad(true);
  Tensor unused = ones({3}, {DType::Float64}).set_requires_grad(true);
  NamedTensors params = {{"a", a}, {"b", b}, {"unused", unused}};
  auto run_backward = [&] {
    a.set_grad(Tensor());
    b.set_grad(Tensor());
    add(sum(mul(a, a.detach())), sum(mul(b, b.detach()))).backward();  // grads = a, b: norm 5
  };
  run_backward();
  Tensor norm = optim::clip_grad_norm(params, 10.0);
  EXPECT_DOUBLE_EQ(norm.item(), 5.0);
  EXPECT_EQ(a.grad().to_vector<double>(), (std::vector<double>{3.0, 0.0})) << "under the limit";
  run_backward();
  norm = optim::clip_grad_norm(params, 1.0);
  EXPECT_DOUBLE_EQ(norm.item(), 5.0);
  auto ga = a.grad().to_vector<double>(), gb = b.grad().to_vector<double>();
  EXPECT_NEAR(ga[0], 3.0 / (5.0 + 1e-6), 1e-12);
  EXPECT_NEAR(gb[1], 4.0 / (5.0 + 1e-6), 1e-12);
  EXPECT_FALSE(unused.grad().defined());
  EXPECT_THROW(optim::clip_grad_norm(params, 0.0), std::invalid_argument);
  EXPECT_FALSE(optim::clip_grad_norm({{"unused", unused}}, 1.0).defined());
}

// More gradients than one fused launch takes (kernels::kMaxFusedTensors),
// sizes under and over its parts' count, and a strided one: the norm of
// them all, and each scaled in place, the strided one through its view.
TEST(Optim, ClipGradNormOverManyGradientsOfEverySize) {
  NamedTensors params;
  double squares = 0;
  std::vector<Tensor> expected;
  for (int i = 0; i < 21; ++i) {
    const int64_t n = i % 3 == 0 ? 1 : 5 * i;
    Tensor p = zeros({n, 1}, {DType::Float64}).set_requires_grad(true);
    // The last: every other column of [n, 2], rows 2 apart.
    Tensor g = i == 20 ? randn({n, 2}, {DType::Float64}).narrow(1, 1, 1)
                       : randn({n, 1}, {DType::Float64});
    p.set_grad(g);
    squares += sum(mul(g, g)).item();
    expected.push_back(g.clone());
    params.emplace_back("p" + std::to_string(i), p);
  }
  ASSERT_FALSE(params.back().second.grad().is_contiguous());
  const double norm = std::sqrt(squares);
  EXPECT_NEAR(optim::clip_grad_norm(params, 1.0).item(), norm, 1e-12 * norm);
  for (size_t i = 0; i < params.size(); ++i) {
    const auto got = params[i].second.grad().to_vector<double>();
    const auto want = expected[i].to_vector<double>();
    for (size_t j = 0; j < got.size(); ++j) EXPECT_NEAR(got[j], want[j] / (norm + 1e-6), 1e-12);
  }
}

TEST(Optim, CosineScheduleWarmsUpThenDecaysToTheFloor) {
  optim::LrSchedule s{.lr = 1e-3, .min_lr = 1e-4, .warmup = 10, .total = 110};
  EXPECT_DOUBLE_EQ(s.at(0), 1e-4);
  EXPECT_DOUBLE_EQ(s.at(9), 1e-3);
  EXPECT_DOUBLE_EQ(s.at(10), 1e-3);
  EXPECT_NEAR(s.at(60), 0.5 * (1e-3 + 1e-4), 1e-15);
  EXPECT_NEAR(s.at(109), 1e-4, 3e-7);  // 0.9e-3 · (1 + cos(0.99π)) / 2 above the floor
  EXPECT_DOUBLE_EQ(s.at(110), 1e-4);
  EXPECT_DOUBLE_EQ(s.at(1000), 1e-4);
  for (int64_t i = 10; i < 110; ++i) EXPECT_LE(s.at(i + 1), s.at(i)) << i;

  Tensor p = ones({2}).set_requires_grad(true);
  optim::Adam opt({{"p", p}}, {});
  opt.set_lr(s.at(3));
  EXPECT_DOUBLE_EQ(opt.lr(), s.at(3));
  EXPECT_THROW(opt.set_lr(0), std::invalid_argument);
}

// A two-block GPT with tied embeddings learns to copy: each row is six
// random tokens and then the same six again, so the second half can only be
// predicted by attending six positions back (no token predicts its
// successor by itself). Fresh rows every step: nothing to memorise.
TEST(Transformer, TinyGptLearnsToCopyFromContext) {
  manual_seed(41);
  auto emb = std::make_shared<Embedding>(16, 32, 12);
  Sequential model;
  model.push_back(emb);
  model.push_back(std::make_shared<TransformerBlock>(32, 4, 0.0, 2));
  model.push_back(std::make_shared<TransformerBlock>(32, 4, 0.0, 2));
  model.push_back(std::make_shared<LayerNorm>(32));
  model.push_back(std::make_shared<TiedOutput>(emb));
  // The table is one parameter, trained through both of its uses.
  int tables = 0;
  for (auto& [name, t] : model.named_parameters()) tables += t.impl() == emb->weight().impl();
  EXPECT_EQ(tables, 1);

  constexpr int64_t kBatch = 32, kHalf = 6, kT = 2 * kHalf;
  std::mt19937_64 rng(7);
  // Inputs: tokens 0..10 of each row; targets: tokens 1..11. The loss that
  // counts is over the targets in the second half (positions 5..10).
  auto batch = [&](Tensor& x, Tensor& y_late) {
    std::vector<int64_t> xs, late;
    for (int64_t b = 0; b < kBatch; ++b) {
      int64_t row[kT];
      for (int64_t t = 0; t < kHalf; ++t) row[t] = row[t + kHalf] = static_cast<int64_t>(rng() % 16);
      for (int64_t t = 0; t + 1 < kT; ++t) xs.push_back(row[t]);
      for (int64_t t = kHalf; t < kT; ++t) late.push_back(row[t]);
    }
    x = from_vector(xs, {kBatch, kT - 1});
    y_late = from_vector(late, {kBatch * kHalf});
  };
  optim::Adam opt(model.named_parameters(),
                  {.lr = 3e-3, .weight_decay = 0.1, .decoupled = true, .decay_matrices_only = true});
  double first = 0, last = 0;
  for (int step = 0; step < 400; ++step) {
    Tensor x, y_late;
    batch(x, y_late);
    opt.zero_grad();
    Tensor logits = model(x);
    ASSERT_EQ(logits.sizes(), (Shape{kBatch, kT - 1, 16}));
    Tensor late = logits.narrow(1, kHalf - 1, kHalf).reshape({kBatch * kHalf, 16});
    Tensor loss = cross_entropy(late, y_late);
    loss.backward();
    optim::clip_grad_norm(model.named_parameters(), 1.0);
    opt.step();
    (step == 0 ? first : last) = loss.item();
  }
  EXPECT_NEAR(first, std::log(16.0), 0.5) << "starts near uniform";
  EXPECT_LT(last, 0.5) << "copies from six tokens back (from " << first << ")";
}

// Causal: a position's output never depends on later tokens.
TEST(Transformer, LaterTokensDoNotChangeEarlierOutputs) {
  manual_seed(42);
  auto emb = std::make_shared<Embedding>(16, 32, 10);
  Sequential model;
  model.push_back(emb);
  model.push_back(std::make_shared<TransformerBlock>(32, 4, 0.0, 1));
  model.push_back(std::make_shared<TiedOutput>(emb));
  Tensor a = from_vector<int64_t>({1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {1, 10});
  Tensor b = from_vector<int64_t>({1, 2, 3, 4, 5, 15, 14, 13, 12, 11}, {1, 10});
  auto la = model(a).to_vector<float>(), lb = model(b).to_vector<float>();
  for (size_t i = 0; i < 5 * 16; ++i) ASSERT_EQ(la[i], lb[i]) << "position " << i / 16;
  bool later_differ = false;
  for (size_t i = 5 * 16; i < la.size(); ++i) later_differ |= la[i] != lb[i];
  EXPECT_TRUE(later_differ);
}

TEST(Transformer, ModulesRejectBadSizes) {
  EXPECT_THROW(TransformerBlock(30, 4, 0.1, 1), std::invalid_argument) << "30 / 4 heads";
  EXPECT_THROW(TransformerBlock(32, 4, 1.0, 1), std::invalid_argument);
  EXPECT_THROW(Embedding(0, 4), std::invalid_argument);
  Embedding e(10, 4, 6);
  EXPECT_THROW(e.forward(from_vector<int64_t>(std::vector<int64_t>(7, 1), {1, 7})),
               std::invalid_argument)
      << "longer than the context";
  TransformerBlock b(8, 2, 0.0, 1);
  EXPECT_THROW(b.forward(ones({2, 8})), std::invalid_argument);
}

// What autocast copies to bfloat16 once a step: the tensors products
// multiply, each once, and nothing else (norms, embeddings read by index).
TEST(Modules, ProductParametersAreWhatProductsMultiply) {
  auto embedding = std::make_shared<Embedding>(16, 8, 4);
  Sequential gpt({embedding, std::make_shared<TransformerBlock>(8, 2, 0.0, 1),
                  std::make_shared<LayerNorm>(8), std::make_shared<TiedOutput>(embedding)});
  const std::vector<Tensor> got = gpt.product_parameters();
  const NamedTensors all = gpt.named_parameters();
  std::vector<std::string> names;
  for (const Tensor& t : got) {
    auto it = std::find_if(all.begin(), all.end(), [&](const auto& named) {
      return named.second.impl() == t.impl();
    });
    ASSERT_NE(it, all.end()) << "not a parameter of the model";
    names.push_back(it->first);
  }
  // qkv, proj, fc1, fc2 (children 2, 3, 4, 5 of the block) and the table.
  const std::vector<std::string> want = {"1.2.weight", "1.2.bias", "1.3.weight", "1.3.bias",
                                         "1.4.weight", "1.4.bias", "1.5.weight", "1.5.bias",
                                         "0.weight"};
  EXPECT_EQ(names, want);
  EXPECT_TRUE(LayerNorm(8).product_parameters().empty());
}

// A Sequential asks a layer for its output in lower precision exactly when
// the next layer reads its input only through a product (a linear layer,
// an output head), and for a plain forward otherwise (the last layer, a
// layer before a norm or a block). Without autocast both give the same.
TEST(Modules, SequentialAsksForLowerPrecisionOnlyBeforeAProduct) {
  struct Recording final : Module {
    std::vector<std::string>* calls;
    std::string name;
    Recording(std::vector<std::string>* c, std::string n) : calls(c), name(std::move(n)) {}
    Tensor forward(const Tensor& x) override {
      calls->push_back(name + " forward");
      return x;
    }
    Tensor forward_lower_precision(const Tensor& x) override {
      calls->push_back(name + " lower");
      return x;
    }
    std::string describe() const override { return name; }
  };
  std::vector<std::string> calls;
  auto embedding = std::make_shared<Embedding>(16, 8);
  Sequential model({std::make_shared<Recording>(&calls, "a"), std::make_shared<Linear>(8, 8),
                    std::make_shared<Recording>(&calls, "b"), std::make_shared<LayerNorm>(8),
                    std::make_shared<Recording>(&calls, "c"), std::make_shared<TiedOutput>(embedding),
                    std::make_shared<Recording>(&calls, "d")});
  const Tensor x = randn({3, 8});
  const Tensor y = model(x);
  EXPECT_EQ(calls, (std::vector<std::string>{"a lower", "b forward", "c lower", "d forward"}));
  EXPECT_TRUE(Linear(8, 8).reads_input_through_product());
  EXPECT_TRUE(TiedOutput(embedding).reads_input_through_product());
  for (const auto& m : std::vector<std::shared_ptr<Module>>{
           std::make_shared<LayerNorm>(8), std::make_shared<GELU>(), std::make_shared<Dropout>(0.1),
           std::make_shared<TransformerBlock>(8, 2, 0.0, 1), embedding}) {
    EXPECT_FALSE(m->reads_input_through_product()) << m->describe();
  }
  // On the CPU (no autocast) a norm's lower-precision output is its output.
  LayerNorm norm(8);
  const Tensor h = randn({5, 8});
  EXPECT_EQ(norm.forward_lower_precision(h).dtype(), DType::Float32);
  EXPECT_EQ(norm.forward_lower_precision(h).to_vector<float>(), norm.forward(h).to_vector<float>());
  EXPECT_EQ(y.sizes(), (Shape{3, 16}));
}

// The CPU's pass over several tensors at once gives each the bits of its
// own conversion, across tensor counts up to the most a launch takes and
// lengths around its groups of eight; more tensors than that is an error.
// On the CPU no step makes copies: autocast never runs there.
TEST(Autocast, WeightCopiesInOnePassAndOnlyWhereAutocastRuns) {
  manual_seed(40);
  std::vector<Tensor> in;
  for (int64_t n : {1, 7, 8, 9, 0, 1000, 4099}) in.push_back(mul(randn({n}), 100.0));
  for (int k = 0; k < kernels::kMaxConvertTensors - 7; ++k) in.push_back(randn({k + 3}));
  kernels::Bf16Copies batch;
  std::vector<Tensor> out;
  int64_t total = 0;
  for (const Tensor& t : in) {
    out.push_back(empty(t.sizes(), {DType::BFloat16, Device::cpu()}));
    batch.in[batch.count] = t.data<float>();
    batch.out[batch.count] = out.back().data<bfloat16>();
    total += t.numel();
    batch.end[batch.count++] = total;
  }
  kernels::cpu::convert_bf16_copies(nullptr, batch);
  for (size_t k = 0; k < in.size(); ++k) {
    SCOPED_TRACE("tensor " + std::to_string(k));
    EXPECT_EQ(out[k].to(DType::Float32).to_vector<float>(),
              in[k].to(DType::BFloat16).to(DType::Float32).to_vector<float>());
  }
  batch.count = kernels::kMaxConvertTensors + 1;
  EXPECT_THROW(kernels::cpu::convert_bf16_copies(nullptr, batch), std::invalid_argument);

  Linear layer(4, 3);
  AutocastGuard autocast(DType::BFloat16);
  AutocastWeights copies(layer.product_parameters());
  EXPECT_EQ(copies.copies(), 0u);
  EXPECT_EQ(copies.find(layer.weight()), nullptr);
  EXPECT_EQ(autocast_copy(layer.weight()).dtype(), DType::BFloat16);
}

// Adam's moments are made with the optimizer, beside the parameters,
// before any step's tensors exist (a job's pages then hold them packed:
// optim.cpp); the first update makes none.
TEST(Optim, AdamMakesItsStateWithTheOptimizerNotAtTheFirstUpdate) {
  Linear layer(64, 32);
  const uint64_t param_bytes = (64 * 32 + 32) * sizeof(float);
  auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
  AllocatorGuard counted(counting);
  uint64_t before = counting->allocated();
  optim::Adam adam(layer.named_parameters(), {});
  // (And the step counter's 8 bytes.)
  EXPECT_GE(counting->allocated() - before, 2 * param_bytes) << "both moments, made now";
  sum(layer(ones({4, 64}))).backward();
  before = counting->allocated();
  adam.step();
  EXPECT_LT(counting->allocated() - before, param_bytes) << "the first update made state";
}

// Only a GPU's parameters have state to move to host memory.
TEST(Optim, StateOfCpuParametersStaysWhereItIs) {
  Linear layer(4, 3);
  optim::Adam adam(layer.named_parameters(), {});
  EXPECT_FALSE(adam.move_state_to_host());
  optim::SGD sgd(layer.named_parameters(), {.lr = 0.1, .momentum = 0.9});
  EXPECT_FALSE(sgd.move_state_to_host());
}

TEST(Optim, RejectsBadHyperParameters) {
  Tensor p = ones({2}).set_requires_grad(true);
  EXPECT_THROW(optim::SGD({{"p", p}}, {.lr = -1}), std::invalid_argument);
  EXPECT_THROW(optim::Adam({{"p", p}}, {.lr = 1e-3, .beta1 = 1.0}), std::invalid_argument);
  EXPECT_THROW(optim::Adam({{"x", ones({2})}}, {}), std::invalid_argument)
      << "a tensor that does not require grad is not a parameter";
}

}  // namespace
}  // namespace leasehold::engine
