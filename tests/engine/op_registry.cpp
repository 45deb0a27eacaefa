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
    c.push_back({"gelu", normal({{3, 5}}), [](auto& x) { return gelu(x[0]); }});
    c.push_back({"gelu large", normal({{1025, 33}}), [](auto& x) { return gelu(x[0]); }, false});
    c.push_back({"layer_norm", normal({{2, 3, 7}, {7}, {7}}),
                 [](auto& x) { return layer_norm(x[0], x[1], x[2]); }});
    c.push_back({"layer_norm strided input", normal({{7, 4}, {4}, {4}}),
                 [](auto& x) { return layer_norm(x[0].narrow(0, 1, 5), x[1], x[2], 1e-3); }});
    // Rows over one warp's width and a chunked column sum (rows > 64).
    c.push_back({"layer_norm wide", normal({{300, 385}, {385}, {385}}),
                 [](auto& x) { return layer_norm(x[0], x[1], x[2]); }, false});
    c.push_back({"embedding", normal({{11, 6}}),
                 [](auto& x) { return embedding(x[0], token_index({3, 5}, 11, x[0].device())); }});
    c.push_back({"embedding bytes", normal({{256, 70}}),
                 [](auto& x) {
                   return embedding(x[0], token_index({4, 1100}, 256, x[0].device()));
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
