#include "tests/engine/op_registry.h"

#include <cmath>

#include "agent/engine/ops.h"

namespace leasehold::engine::testing {
namespace {

const TensorOptions f64{DType::Float64};

std::function<std::vector<Tensor>()> normal(std::vector<Shape> shapes) {
  return [shapes] {
    std::vector<Tensor> out;
    for (const Shape& s : shapes) out.push_back(randn(s, f64));
    return out;
  };
}

// |x| in [0.2, 1.2] with random signs: away from the kinks of relu, abs
// and division, where the derivative is undefined.
Tensor away_from_zero(const Shape& s) {
  auto m = rand(s, f64, 0.2, 1.2).to_vector<double>();
  auto sign = rand(s, f64, -1, 1).to_vector<double>();
  for (size_t i = 0; i < m.size(); ++i) m[i] = sign[i] < 0 ? -m[i] : m[i];
  return from_vector(m, s);
}

// Values in [low, high) (positive ones for log, sqrt and negative powers).
std::function<std::vector<Tensor>()> between(Shape shape, double low, double high) {
  return [=] { return std::vector<Tensor>{rand(shape, f64, low, high)}; };
}

// Distinct values, so the max of every pooling window is unique.
Tensor distinct(const Shape& shape) {
  std::vector<double> v(static_cast<size_t>(numel_of(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(double(i) * 1.7) + double(i) * 1e-3;
  return from_vector(v, shape);
}

using Inputs = std::vector<Tensor>;

// Indices with repeats (the embedding gradient sums them) and every end of
// the range.
Tensor token_index(const Shape& shape, int64_t vocab, Device device) {
  std::vector<int64_t> v(static_cast<size_t>(numel_of(shape)));
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>((i * 7 + i / 3) % vocab);
  if (!v.empty()) v.back() = vocab - 1;
  return from_vector(v, shape, device);
}

OpCase attention_case(const std::string& name, Shape shape, bool causal, bool gradcheck,
                      double tolerance = 1e-4) {
  return {name, normal({shape, shape, shape}),
          [causal](const std::vector<Tensor>& x) {
            return scaled_dot_product_attention(x[0], x[1], x[2], causal);
          },
          gradcheck, tolerance};
}

}  // namespace

const std::vector<OpCase>& op_cases() {
  static const std::vector<OpCase> cases = [] {
    std::vector<OpCase> c;
    // Elementwise, binary ones broadcasting.
    const auto pair = [] { return Inputs{randn({3, 1, 4}, f64), randn({5, 1}, f64)}; };
    c.push_back({"add", pair, [](auto& x) { return add(x[0], x[1]); }});
    c.push_back({"sub", pair, [](auto& x) { return sub(x[0], x[1]); }});
    c.push_back({"mul", pair, [](auto& x) { return mul(x[0], x[1]); }});
    c.push_back({"div", [] { return Inputs{randn({3, 1, 4}, f64), away_from_zero({5, 1})}; },
                 [](auto& x) { return div(x[0], x[1]); }});
    c.push_back({"scalar ops", normal({{3, 4}}),
                 [](auto& x) { return add(mul(x[0], 2.5), -1.0); }});
    const auto signed_values = [] { return Inputs{away_from_zero({2, 3, 5})}; };
    c.push_back({"neg", signed_values, [](auto& x) { return neg(x[0]); }});
    c.push_back({"exp", signed_values, [](auto& x) { return exp(x[0]); }});
    c.push_back({"log", between({7}, 0.5, 3), [](auto& x) { return log(x[0]); }});
    c.push_back({"pow 3", signed_values, [](auto& x) { return pow(x[0], 3.0); }});
    c.push_back({"pow -1.5", between({7}, 0.5, 3), [](auto& x) { return pow(x[0], -1.5); }});
    c.push_back({"sqrt", between({7}, 0.5, 3), [](auto& x) { return sqrt(x[0]); }});
    c.push_back({"abs", signed_values, [](auto& x) { return abs(x[0]); }});
    c.push_back({"relu", signed_values, [](auto& x) { return relu(x[0]); }});
    c.push_back({"sigmoid", signed_values, [](auto& x) { return sigmoid(x[0]); }});
    c.push_back({"tanh", signed_values, [](auto& x) { return tanh(x[0]); }});
    // Products.
    c.push_back({"matmul", normal({{3, 7}, {7, 2}}),
                 [](auto& x) { return matmul(x[0], x[1]); }});
    c.push_back({"matmul batched", normal({{2, 3, 4}, {2, 4, 5}}),
                 [](auto& x) { return matmul(x[0], x[1]); }});
    c.push_back({"matmul shared right", normal({{2, 3, 4}, {4, 5}}),
                 [](auto& x) { return matmul(x[0], x[1]); }});
    c.push_back({"matmul transposed", normal({{7, 3}, {7, 2}}),
                 [](auto& x) { return matmul(x[0].transpose(0, 1), x[1]); }});
    c.push_back({"linear", normal({{5, 7}, {3, 7}, {3}}),
                 [](auto& x) { return linear(x[0], x[1], x[2]); }});
    c.push_back({"linear no bias", normal({{5, 7}, {3, 7}}),
                 [](auto& x) { return linear(x[0], x[1], Tensor()); }});
    c.push_back({"linear views", normal({{7, 5}, {4, 7}, {3}}), [](auto& x) {
                   return linear(x[0].transpose(0, 1), x[1].narrow(0, 1, 3), x[2]);
                 }});
    c.push_back({"linear relu", [] { return Inputs{randn({6, 5}, f64), randn({4, 5}, f64),
                                                   away_from_zero({4})}; },
                 [](auto& x) { return linear(x[0], x[1], x[2], true); }});
    // Reductions, softmax and losses.
    c.push_back({"sum", normal({{3, 4, 5}}), [](auto& x) { return sum(x[0]); }});
    c.push_back({"sum dim", normal({{3, 4, 5}}), [](auto& x) { return sum(x[0], {1}); }});
    c.push_back({"sum keepdim", normal({{3, 4, 5}}),
                 [](auto& x) { return sum(x[0], {0, 2}, true); }});
    // Column sums over more rows than one pass takes (CUDA: partial sums of
    // row parts, then theirs): a batch's bias gradient at a GPT's size.
    c.push_back({"sum many leading rows", normal({{5000, 7}}),
                 [](auto& x) { return sum(x[0], {0}); }, false});
    c.push_back({"sum many leading rows keepdim", normal({{3, 2100, 5}}),
                 [](auto& x) { return sum(x[0], {0, 1}, true); }, false});
    c.push_back({"sum of many elements", normal({{5000, 3}}),
                 [](auto& x) { return sum(x[0]); }, false});
    c.push_back({"linear bias over many rows", [] { return Inputs{randn({4500, 6}, f64),
                                                              randn({3, 6}, f64), randn({3}, f64)}; },
                 [](auto& x) { return linear(x[0], x[1], x[2]); }, false});
    c.push_back({"mean", normal({{3, 4, 5}}), [](auto& x) { return mean(x[0], {-1}); }});
    c.push_back({"max", normal({{3, 4, 5}}), [](auto& x) { return max(x[0], 1).first; }});
    c.push_back({"max keepdim", normal({{3, 4, 5}}),
                 [](auto& x) { return max(x[0], 2, true).first; }});
    c.push_back({"softmax", normal({{4, 6}}), [](auto& x) { return softmax(x[0], 1); }});
    c.push_back({"softmax dim 0", normal({{4, 6}}), [](auto& x) { return softmax(x[0], 0); }});
    c.push_back({"log_softmax", normal({{4, 6}}), [](auto& x) { return log_softmax(x[0], -1); }});
    c.push_back({"log_softmax inner", normal({{3, 2, 5}}),
                 [](auto& x) { return log_softmax(x[0], 0); }});
    c.push_back({"cross_entropy", normal({{4, 6}}), [](auto& x) {
                   return cross_entropy(x[0], from_vector<int64_t>({0, 5, 2, 2}, {4},
                                                                   x[0].device()));
                 }});
    c.push_back({"mse_loss", normal({{4, 6}, {4, 6}}),
                 [](auto& x) { return mse_loss(x[0], x[1]); }});
    c.push_back({"l1_loss", [] {
                   Tensor a = randn({4, 6}, f64);
                   return Inputs{a, add(a, away_from_zero({4, 6}))};
                 },
                 [](auto& x) { return l1_loss(x[0], x[1]); }});
    // Convolution and pooling.
    c.push_back({"conv2d", normal({{2, 3, 6, 5}, {4, 3, 3, 3}, {4}}),
                 [](auto& x) { return conv2d(x[0], x[1], x[2], 1, 0); }, true, 1e-4, 1e-5});
    c.push_back({"conv2d strided padded", normal({{1, 2, 7, 7}, {3, 2, 3, 3}}),
                 [](auto& x) { return conv2d(x[0], x[1], Tensor(), 2, 1); }, true, 1e-4, 1e-5});
    c.push_back({"max_pool2d", [] { return Inputs{distinct({2, 2, 6, 6})}; },
                 [](auto& x) { return max_pool2d(x[0], 2); }});
    c.push_back({"max_pool2d overlapping", [] { return Inputs{distinct({2, 2, 6, 6})}; },
                 [](auto& x) { return max_pool2d(x[0], 3, 1); }});
    // Views and dropout (one mask for every evaluation: the same seed).
    c.push_back({"permute", normal({{2, 3, 4}}),
                 [](auto& x) { return x[0].permute({2, 0, 1}).contiguous(); }});
    c.push_back({"narrow expand", normal({{2, 3, 4}}),
                 [](auto& x) { return x[0].narrow(0, 1, 1).expand({3, 3, 4}); }});
    c.push_back({"dropout", normal({{2, 3, 4}}), [](auto& x) {
                   manual_seed(99);
                   return dropout(x[0], 0.4, true);
                 }});
    c.push_back({"add dropout", normal({{2, 3, 4}, {2, 3, 4}}), [](auto& x) {
                   manual_seed(99);
                   return add_dropout(x[0], x[1], 0.4, true);
                 }});
    // Transformer layers.
    c.push_back({"gelu", normal({{3, 5}}), [](auto& x) { return gelu(x[0]); }});
    c.push_back({"linear gelu", normal({{5, 7}, {3, 7}, {3}}),
                 [](auto& x) { return linear_gelu(x[0], x[1], x[2]); }});
    c.push_back({"gelu large", normal({{1025, 33}}), [](auto& x) { return gelu(x[0]); }, false});
    c.push_back({"layer_norm", normal({{2, 3, 7}, {7}, {7}}),
                 [](auto& x) { return layer_norm(x[0], x[1], x[2]); }});
    c.push_back({"layer_norm strided input", normal({{7, 4}, {4}, {4}}),
                 [](auto& x) { return layer_norm(x[0].narrow(0, 1, 5), x[1], x[2], 1e-3); }});
    // Rows over one warp's width and a chunked column sum (rows > 64).
    c.push_back({"layer_norm wide", normal({{300, 385}, {385}, {385}}),
                 [](auto& x) { return layer_norm(x[0], x[1], x[2]); }, false});
    // float32 rows held in registers on CUDA (widths a multiple of 4 up to
    // 1024): one, three and eight steps of 128 columns, rows over several
    // chunks and not a multiple of the block's warps.
    c.push_back({"layer_norm in registers", normal({{300, 384}, {384}, {384}}),
                 [](auto& x) { return layer_norm(x[0], x[1], x[2]); }, false});
    c.push_back({"layer_norm in registers narrow", normal({{131, 8}, {8}, {8}}),
                 [](auto& x) { return layer_norm(x[0], x[1], x[2]); }, false});
    c.push_back({"layer_norm in registers widest", normal({{70, 1024}, {1024}, {1024}}),
                 [](auto& x) { return layer_norm(x[0], x[1], x[2]); }, false});
    // More chunks of rows than the chunks' final sum has lanes (47 of 64 rows).
    c.push_back({"layer_norm in registers many rows", normal({{3000, 64}, {64}, {64}}),
                 [](auto& x) { return layer_norm(x[0], x[1], x[2]); }, false});
    c.push_back({"embedding", normal({{11, 6}}),
                 [](auto& x) { return embedding(x[0], token_index({3, 5}, 11, x[0].device())); }});
    c.push_back({"embedding bytes", normal({{256, 70}}),
                 [](auto& x) {
                   return embedding(x[0], token_index({4, 1100}, 256, x[0].device()));
                 },
                 false});
    // A large vocabulary, most rows unused, one index far more common than
    // the rest (its run spans many of the sort's chunks) and rows wider
    // than one block's columns.
    c.push_back({"embedding skewed", normal({{5000, 130}}),
                 [](auto& x) {
                   std::vector<int64_t> v(3000);
                   for (size_t i = 0; i < v.size(); ++i) {
                     v[i] = i % 3 ? 17 : static_cast<int64_t>((i * 131) % 5000);
                   }
                   return embedding(x[0], from_vector(v, {30, 100}, x[0].device()));
                 },
                 false});
    c.push_back(attention_case("attention causal", {2, 2, 5, 4}, true, true));
    c.push_back(attention_case("attention full", {1, 2, 3, 3}, false, true));
    c.push_back(attention_case("attention one token", {2, 1, 1, 5}, true, true));
    // Sequence lengths across the kernels' tiles (not multiples of 32 or
    // 64), one head, head sizes 32, 64 and one that is padded (48).
    c.push_back(attention_case("attention t=70 d=64", {1, 1, 70, 64}, true, false));
    c.push_back(attention_case("attention t=129 d=32 2 heads", {2, 2, 129, 32}, true, false));
    c.push_back(attention_case("attention t=97 d=48 full", {1, 3, 97, 48}, false, false));
    c.push_back(attention_case("attention t=200 d=128", {1, 1, 200, 128}, true, false));
    // The fused projection's layout: q, k and v read in place, heads merged.
    c.push_back({"self_attention", normal({{2, 5, 3 * 2 * 4}}),
                 [](auto& x) { return self_attention(x[0], 2, true); }});
    c.push_back({"self_attention full", normal({{1, 4, 3 * 3 * 2}}),
                 [](auto& x) { return self_attention(x[0], 3, false); }});
    c.push_back({"self_attention t=130 d=64", normal({{2, 130, 3 * 3 * 64}}),
                 [](auto& x) { return self_attention(x[0], 3, true); }, false});
    c.push_back({"self_attention t=97 d=48 view", normal({{2, 97, 3 * 2 * 48 + 5}}),
                 [](auto& x) { return self_attention(x[0].narrow(2, 5, 3 * 2 * 48), 2, true); },
                 false});
    return c;
  }();
  return cases;
}

Tensor reference_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal) {
  const int64_t t = q.size(2), d = q.size(3), heads = q.size(0) * q.size(1);
  const Tensor q3 = q.reshape({heads, t, d}), k3 = k.reshape({heads, t, d});
  Tensor scores = mul(matmul(q3, k3.transpose(1, 2)), 1.0 / std::sqrt(static_cast<double>(d)));
  if (causal) {
    std::vector<double> mask(static_cast<size_t>(t * t));
    for (int64_t i = 0; i < t; ++i) {
      for (int64_t j = 0; j < t; ++j) mask[i * t + j] = j <= i ? 0.0 : -1e30;
    }
    scores = add(scores, from_vector(mask, {t, t}, q.device()).to(q.dtype()));
  }
  return matmul(softmax(scores, -1), v.reshape({heads, t, d})).reshape(q.sizes());
}

}  // namespace leasehold::engine::testing
