// Every differentiable operator's backward against central differences in
// float64. Inputs are kept away from kinks (relu, abs, max ties) where the
// derivative is undefined.
#include <gtest/gtest.h>

#include <cmath>

#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "tests/engine/gradcheck.h"
#include "tests/engine/op_registry.h"

namespace leasehold::engine::testing {
namespace {

const TensorOptions f64{DType::Float64};

// |x| in [0.2, 1.2] with random signs.
Tensor away_from_zero(const Shape& s) {
  auto m = rand(s, f64, 0.2, 1.2).to_vector<double>();
  auto sign = rand(s, f64, -1, 1).to_vector<double>();
  for (size_t i = 0; i < m.size(); ++i) m[i] = sign[i] < 0 ? -m[i] : m[i];
  return from_vector(m, s);
}

#define EXPECT_GRAD_OK(...) EXPECT_EQ(gradcheck(__VA_ARGS__), "")

TEST(Gradcheck, BinaryWithBroadcasting) {
  manual_seed(1);
  auto a = randn({3, 1, 4}, f64), b = randn({5, 1}, f64);
  EXPECT_GRAD_OK([](auto& x) { return add(x[0], x[1]); }, {a, b});
  EXPECT_GRAD_OK([](auto& x) { return sub(x[0], x[1]); }, {a, b});
  EXPECT_GRAD_OK([](auto& x) { return mul(x[0], x[1]); }, {a, b});
  EXPECT_GRAD_OK([](auto& x) { return div(x[0], x[1]); }, {a, away_from_zero({5, 1})});
  EXPECT_GRAD_OK([](auto& x) { return add(mul(x[0], 2.5), -1.0); }, {a});
}

TEST(Gradcheck, Unary) {
  manual_seed(2);
  auto x = away_from_zero({2, 3, 5});
  EXPECT_GRAD_OK([](auto& v) { return neg(v[0]); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return exp(v[0]); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return log(v[0]); }, {rand({7}, f64, 0.5, 3)});
  EXPECT_GRAD_OK([](auto& v) { return pow(v[0], 3.0); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return pow(v[0], -1.5); }, {rand({7}, f64, 0.5, 3)});
  EXPECT_GRAD_OK([](auto& v) { return sqrt(v[0]); }, {rand({7}, f64, 0.5, 3)});
  EXPECT_GRAD_OK([](auto& v) { return abs(v[0]); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return relu(v[0]); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return sigmoid(v[0]); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return tanh(v[0]); }, {x});
}

TEST(Gradcheck, Matmul) {
  manual_seed(3);
  EXPECT_GRAD_OK([](auto& v) { return matmul(v[0], v[1]); }, {randn({3, 7}, f64), randn({7, 2}, f64)});
  EXPECT_GRAD_OK([](auto& v) { return matmul(v[0], v[1]); },
                 {randn({2, 3, 4}, f64), randn({2, 4, 5}, f64)});
  EXPECT_GRAD_OK([](auto& v) { return matmul(v[0], v[1]); },
                 {randn({2, 3, 4}, f64), randn({4, 5}, f64)});
  // Non-contiguous operands.
  EXPECT_GRAD_OK([](auto& v) { return matmul(v[0].transpose(0, 1), v[1]); },
                 {randn({7, 3}, f64), randn({7, 2}, f64)});
}

TEST(Gradcheck, Linear) {
  manual_seed(13);
  EXPECT_GRAD_OK([](auto& v) { return linear(v[0], v[1], v[2]); },
                 {randn({5, 7}, f64), randn({3, 7}, f64), randn({3}, f64)});
  EXPECT_GRAD_OK([](auto& v) { return linear(v[0], v[1], Tensor()); },
                 {randn({5, 7}, f64), randn({3, 7}, f64)});
  // A transposed input and a weight viewed from a larger one.
  EXPECT_GRAD_OK([](auto& v) { return linear(v[0].transpose(0, 1), v[1].narrow(0, 1, 3), v[2]); },
                 {randn({7, 5}, f64), randn({4, 7}, f64), randn({3}, f64)});
  EXPECT_THROW(linear(ones({2, 3}), ones({4, 2}), Tensor()), std::invalid_argument);
  EXPECT_THROW(linear(ones({2, 3}), ones({4, 3}), ones({3})), std::invalid_argument);
}

TEST(Gradcheck, Reductions) {
  manual_seed(4);
  auto x = randn({3, 4, 5}, f64);
  EXPECT_GRAD_OK([](auto& v) { return sum(v[0]); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return sum(v[0], {1}); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return sum(v[0], {0, 2}, true); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return mean(v[0], {-1}); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return max(v[0], 1).first; }, {x});
  EXPECT_GRAD_OK([](auto& v) { return max(v[0], 2, true).first; }, {x});
}

TEST(Gradcheck, SoftmaxAndLosses) {
  manual_seed(5);
  auto x = randn({4, 6}, f64);
  EXPECT_GRAD_OK([](auto& v) { return softmax(v[0], 1); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return softmax(v[0], 0); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return log_softmax(v[0], -1); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return log_softmax(v[0], 0); }, {randn({3, 2, 5}, f64)});
  Tensor labels = from_vector<int64_t>({0, 5, 2, 2}, {4});
  EXPECT_GRAD_OK([&](auto& v) { return cross_entropy(v[0], labels); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return mse_loss(v[0], v[1]); }, {x, randn({4, 6}, f64)});
  EXPECT_GRAD_OK([](auto& v) { return l1_loss(v[0], v[1]); },
                 {x, add(x.detach(), away_from_zero({4, 6}))});
}

TEST(Gradcheck, ConvAndPool) {
  manual_seed(6);
  EXPECT_GRAD_OK([](auto& v) { return conv2d(v[0], v[1], v[2], 1, 0); },
                 {randn({2, 3, 6, 5}, f64), randn({4, 3, 3, 3}, f64), randn({4}, f64)}, 1e-6,
                 1e-5);
  EXPECT_GRAD_OK([](auto& v) { return conv2d(v[0], v[1], Tensor(), 2, 1); },
                 {randn({1, 2, 7, 7}, f64), randn({3, 2, 3, 3}, f64)}, 1e-6, 1e-5);
  // Distinct values so the max of each window is unique.
  std::vector<double> vals(2 * 2 * 6 * 6);
  for (size_t i = 0; i < vals.size(); ++i) vals[i] = std::sin(double(i) * 1.7) + i * 1e-3;
  EXPECT_GRAD_OK([](auto& v) { return max_pool2d(v[0], 2); }, {from_vector(vals, {2, 2, 6, 6})});
  EXPECT_GRAD_OK([](auto& v) { return max_pool2d(v[0], 3, 1); },
                 {from_vector(vals, {2, 2, 6, 6})});
}

TEST(Gradcheck, ViewsAndDropout) {
  manual_seed(7);
  auto x = randn({2, 3, 4}, f64);
  EXPECT_GRAD_OK([](auto& v) { return v[0].reshape({4, 6}); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return v[0].permute({2, 0, 1}).contiguous(); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return v[0].narrow(2, 1, 2); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return v[0].narrow(0, 1, 1).expand({3, 3, 4}); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return v[0].flatten(1); }, {x});
  EXPECT_GRAD_OK([](auto& v) { return mul(v[0].transpose(0, 2), 3.0); }, {x});
  EXPECT_GRAD_OK(
      [](auto& v) {
        manual_seed(99);  // the same mask for every evaluation
        return dropout(v[0], 0.4, true);
      },
      {x});
}

// Every operator of the shared list (op_registry.h) small enough for finite
// differences.
TEST(Gradcheck, RegisteredOperators) {
  for (const OpCase& c : op_cases()) {
    if (!c.gradcheck) continue;
    SCOPED_TRACE(c.name);
    manual_seed(21);
    EXPECT_GRAD_OK(c.fn, c.inputs());
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

// A whole pre-norm block (layer norms, the fused attention, GELU MLP and
// both residual paths) in float64, with respect to its input.
TEST(Gradcheck, TransformerBlock) {
  manual_seed(23);
  nn::TransformerBlock block(8, 2, 0.0, 1, f64);
  EXPECT_GRAD_OK([&](auto& v) { return block.forward(v[0]); }, {randn({2, 5, 8}, f64)}, 1e-6,
                 1e-5);
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
