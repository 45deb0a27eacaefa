// Every differentiable operator's backward against central differences in
// float64: the registered operators (op_registry.h, whose inputs keep away
// from kinks where the derivative is undefined), views, and whole blocks.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string_view>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "tests/engine/counting_allocator.h"
#include "tests/engine/fused_check.h"
#include "tests/engine/gradcheck.h"
#include "tests/engine/op_registry.h"

namespace leasehold::engine::testing {
namespace {

const TensorOptions f64{DType::Float64};

#define EXPECT_GRAD_OK(...) EXPECT_EQ(gradcheck(__VA_ARGS__), "")

TEST(Gradcheck, LinearRejectsMismatchedShapes) {
  EXPECT_THROW(linear(ones({2, 3}), ones({4, 2}), Tensor()), std::invalid_argument);
  EXPECT_THROW(linear(ones({2, 3}), ones({4, 3}), ones({3})), std::invalid_argument);
}

TEST(Gradcheck, Views) {
  manual_seed(7);
  auto x = randn({2, 3, 4}, f64);
  EXPECT_GRAD_OK([](auto& v) { return v[0].reshape({4, 6}); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return v[0].narrow(2, 1, 2); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return v[0].flatten(1); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return mul(v[0].transpose(0, 2), 3.0); }, {x});
}

// Every operator of the shared list (op_registry.h) small enough for finite
// differences.
TEST(Gradcheck, RegisteredOperators) {
  for (const OpCase& c : op_cases()) {
    if (!c.gradcheck) continue;
    SCOPED_TRACE(c.name);
    manual_seed(21);
    EXPECT_GRAD_OK(c.fn, c.inputs(), 1e-6, c.gradcheck_tolerance);
  }
}

// The fused attention kernel against softmax(q kᵀ / √d) v computed with its
// scores in memory: the same values and the same gradients.
TEST(Attention, FusedMatchesThePlainFormula) {
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    manual_seed(22);
    std::vector<Tensor> fused, plain;
    for (int i = 0; i < 3; ++i) {
      Tensor x = randn({2, 3, 9, 5}, f64);
      fused.push_back(x.clone().set_requires_grad(true));
      plain.push_back(x.clone().set_requires_grad(true));
    }
    Tensor a = scaled_dot_product_attention(fused[0], fused[1], fused[2], causal);
    Tensor b = reference_attention(plain[0], plain[1], plain[2], causal);
    EXPECT_LE(max_rel_diff(a, b), 1e-12);
    Tensor r = randn(a.sizes(), f64);
    sum(mul(a, r)).backward();
    sum(mul(b, r)).backward();
    for (int i = 0; i < 3; ++i) EXPECT_LE(max_rel_diff(fused[i].grad(), plain[i].grad()), 1e-12);
  }
}

// self_attention on a fused projection against splitting it into q, k and
// v, attention on the parts and merging the heads: the same values and
// gradients, without the copies.
TEST(Attention, SelfAttentionMatchesSplitAndMerge) {
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "full");
    manual_seed(23);
    Tensor x = randn({2, 7, 3 * 3 * 4}, f64);
    Tensor a = x.clone().set_requires_grad(true), b = x.clone().set_requires_grad(true);
    Tensor fused = self_attention(a, 3, causal);
    Tensor qkv = b.view({2, 7, 3, 3, 4}).permute({2, 0, 3, 1, 4});
    auto part = [&](int64_t i) { return qkv.narrow(0, i, 1).reshape({2, 3, 7, 4}); };
    Tensor split = scaled_dot_product_attention(part(0), part(1), part(2), causal)
                       .transpose(1, 2)
                       .reshape({2, 7, 12});
    EXPECT_LE(max_rel_diff(fused, split), 1e-12);
    Tensor r = randn(fused.sizes(), f64);
    sum(mul(fused, r)).backward();
    sum(mul(split, r)).backward();
    EXPECT_LE(max_rel_diff(a.grad(), b.grad()), 1e-12);
  }
  EXPECT_THROW(self_attention(ones({2, 3, 10}), 3, true), std::invalid_argument);
  EXPECT_THROW(self_attention(ones({2, 9}), 3, true), std::invalid_argument);
  EXPECT_THROW(self_attention(ones({2, 3, 9}), 0, true), std::invalid_argument);
}

// self_attention keeping its result for a run again (a block recomputed
// but its attention): the first run fills `kept`; the second, on qkv made
// again, returns the kept output and gives qkv the plain operator's
// gradient, bit for bit, and empties `kept`. A kept output of another
// shape than qkv gives is a logic error naming both.
TEST(Attention, KeptAttentionRunsAgainOnTheKeptOutput) {
  manual_seed(29);
  const Tensor x = randn({2, 7, 3 * 3 * 4}, f64);
  KeptAttention kept;
  Tensor first;
  {
    NoGradGuard no_grad;
    first = self_attention(x, 3, true, kept);
  }
  ASSERT_TRUE(kept.filled);
  Tensor a = x.clone().set_requires_grad(true), b = x.clone().set_requires_grad(true);
  Tensor again = self_attention(a, 3, true, kept);
  EXPECT_FALSE(kept.filled);
  EXPECT_EQ(again.data<double>(), first.data<double>()) << "the kept output, not a new one";
  EXPECT_EQ(again.to_vector<double>(), first.to_vector<double>());
  Tensor plain = self_attention(b, 3, true);
  Tensor r = randn(plain.sizes(), f64);
  sum(mul(again, r)).backward();
  sum(mul(plain, r)).backward();
  EXPECT_EQ(a.grad().to_vector<double>(), b.grad().to_vector<double>());

  // Only the first run, without gradients, fills it (a run with them keeps
  // its output in its node).
  (void)self_attention(x.clone().set_requires_grad(true), 3, true, kept);
  EXPECT_FALSE(kept.filled);
  {
    NoGradGuard no_grad;
    (void)self_attention(x, 3, true, kept);
  }
  try {
    (void)self_attention(x.narrow(1, 0, 5), 3, true, kept);
    ADD_FAILURE() << "a kept output of another shape was taken";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 7, 12]"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("[2, 5, 12]"), std::string::npos) << e.what();
  }
}

// A whole pre-norm block (layer norms, the fused attention, GELU MLP and
// both residual paths) in float64, with respect to its input.
TEST(Gradcheck, TransformerBlock) {
  manual_seed(23);
  nn::TransformerBlock block(8, 2, 0.0, 1, f64);
  EXPECT_GRAD_OK([&](auto& v) { return block.forward(v[0]); }, {randn({2, 5, 8}, f64)}, 1e-6,
                 1e-5);
}

// A residual stream's gradient added by layer norm's backward as it writes
// its own: the same bits as the addition after (fused_check.h).
TEST(TransformerOps, LayerNormTakesItsInputsOtherGradientBitForBit) {
  EXPECT_EQ(layer_norm_fold_mismatch(Device::cpu()), "");
  // What it takes: x's type, shape and device, contiguous, 16-byte aligned
  // (never deciding which kernel runs); what it took is in x's gradient.
  manual_seed(31);
  Tensor x = randn({4, 8}).set_requires_grad(true);
  const Tensor w = randn({8}), b = randn({8}), g = randn({4, 8});
  Tensor y = layer_norm(x, w, b);
  Node& node = *y.grad_fn();
  EXPECT_FALSE(node.fold_into_input0(ones({4, 8}, {DType::Float64})));
  EXPECT_FALSE(node.fold_into_input0(ones({8, 4})));
  EXPECT_FALSE(node.fold_into_input0(ones({8, 4}).permute({1, 0})));
  const Tensor off = ones({33}).narrow(0, 1, 32).reshape({4, 8});
  ASSERT_TRUE(off.is_contiguous());
  EXPECT_FALSE(node.fold_into_input0(off));
  const Tensor taken = randn({4, 8});
  EXPECT_TRUE(node.fold_into_input0(taken));
  y.backward(g);
  Tensor x2 = x.detach().set_requires_grad(true);
  layer_norm(x2, w, b).backward(g);
  EXPECT_EQ(x.grad().to_vector<float>(), add(x2.grad(), taken).to_vector<float>());
}

// Where the sum so far is the engine's alone (a residual stream's
// gradient, made by the product on the residual path), layer norm's
// backward writes x's gradient over it: none of x's size is made. Where
// the caller still holds it (backward's own gradient, passed on as it
// came), it makes its own. The sum is x's either way.
TEST(TransformerOps, LayerNormWritesItsInputsGradientOverASumSoFarOfItsOwn) {
  manual_seed(37);
  const Tensor w = randn({16}), b = randn({16}), c = randn({8, 16}), gu = randn({8, 16});
  const Tensor x0 = randn({8, 16});
  auto run = [&](bool sum_owned) {
    const size_t x_bytes = 8 * 16 * sizeof(float);
    auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
    int made = 0;
    counting->on_allocate = [&](size_t bytes) {
      made += bytes == x_bytes && std::string_view(backward_node_running()) == "LayerNormBackward";
    };
    AllocatorGuard counted(counting);
    Tensor x = x0.clone().set_requires_grad(true);
    Tensor h = mul(x, 3.0);
    // (The residual, the addition's second input, has its part summed
    // first.)
    Tensor out = add(layer_norm(h, w, b), sum_owned ? mul(h, c) : h);
    h = Tensor();
    out.backward(gu);
    return std::make_pair(made, x.grad().to_vector<float>());
  };
  // The norm's own part, alone.
  Tensor h = mul(x0, 3.0).set_requires_grad(true);
  layer_norm(h, w, b).backward(gu);
  const Tensor own = h.grad();
  const auto [owned_made, owned_grad] = run(true);
  EXPECT_EQ(owned_made, 0) << "x's gradient made apart from the sum so far of its own";
  EXPECT_EQ(owned_grad, mul(add(own, mul(gu, c)), 3.0).to_vector<float>());
  const auto [shared_made, shared_grad] = run(false);
  EXPECT_EQ(shared_made, 1) << "written over backward's own gradient, which its caller holds";
  EXPECT_EQ(shared_grad, mul(add(own, gu), 3.0).to_vector<float>());
}

TEST(TransformerOps, RejectBadInputs) {
  EXPECT_THROW(embedding(ones({4}), from_vector<int64_t>({0}, {1})), std::invalid_argument);
  EXPECT_THROW(embedding(ones({4, 2}), ones({3})), std::invalid_argument) << "float index";
  try {
    embedding(ones({4, 2}), from_vector<int64_t>({1, 4}, {2}));
    ADD_FAILURE() << "an index past the vocabulary was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("index 4 out of range for a vocabulary of 4"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(embedding(ones({4, 2}), from_vector<int64_t>({-1}, {1})), std::invalid_argument);
  EXPECT_THROW(layer_norm(ones({2, 3}), ones({2}), ones({3})), std::invalid_argument);
  EXPECT_THROW(layer_norm(ones({2, 3}), ones({3}), ones({3}), 0.0), std::invalid_argument);
  EXPECT_THROW(layer_norm(ones({2, 3}), ones({3}, f64), ones({3})), std::invalid_argument);
  {
    // On the CPU autocast changes nothing: the lower precision is float32.
    AutocastGuard autocast(DType::BFloat16);
    const Tensor x = randn({4, 8}), w = randn({8}), b = randn({8});
    const Tensor y = layer_norm(x, w, b, 1e-5, ProductOut::LowerPrecision);
    EXPECT_EQ(y.dtype(), DType::Float32);
    EXPECT_EQ(y.to_vector<float>(), layer_norm(x, w, b).to_vector<float>());
  }
  EXPECT_THROW(scaled_dot_product_attention(ones({2, 3, 4}), ones({2, 3, 4}), ones({2, 3, 4}),
                                            true),
               std::invalid_argument)
      << "three dimensions";
  EXPECT_THROW(scaled_dot_product_attention(ones({1, 1, 3, 4}), ones({1, 1, 2, 4}),
                                            ones({1, 1, 3, 4}), true),
               std::invalid_argument)
      << "mismatched key";
  EXPECT_THROW(scaled_dot_product_attention(ones({1, 1, 3, 0}), ones({1, 1, 3, 0}),
                                            ones({1, 1, 3, 0}), true),
               std::invalid_argument);
}

}  // namespace
}  // namespace leasehold::engine::testing
