// Transformer operators: embedding, layer norm and fused attention. Each
// picks its kernel from a KernelTable by the tensors' device.
#include <cmath>
#include <stdexcept>
#include <string>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/transformer.h"

namespace leasehold::engine {
namespace {

template <class T>
const auto kEmbeddingForward = LEASEHOLD_KERNEL_TABLE("embedding", embedding_forward, T);
template <class T>
const auto kEmbeddingBackward = LEASEHOLD_KERNEL_TABLE("embedding", embedding_backward, T);
template <class T>
const auto kLayerNormForward = LEASEHOLD_KERNEL_TABLE("layer_norm", layer_norm_forward, T);
template <class T>
const auto kLayerNormBackward = LEASEHOLD_KERNEL_TABLE("layer_norm", layer_norm_backward, T);
template <class T>
const auto kAttentionForward =
    LEASEHOLD_KERNEL_TABLE("scaled_dot_product_attention", attention_forward, T);
template <class T>
const auto kAttentionBackward =
    LEASEHOLD_KERNEL_TABLE("scaled_dot_product_attention", attention_backward, T);

// ---- embedding ----

struct EmbeddingBackward final : Node {
  SavedTensor index;  // contiguous, flattened
  int64_t vocab = 0, dim = 0;
  const char* name() const override { return "EmbeddingBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    const Tensor idx = index.get();
    const Tensor gc = g.contiguous();
    Tensor dw = empty({vocab, dim}, g.options());
    detail::dispatch_floating(g.dtype(), "embedding backward", [&](auto tag) {
      using T = decltype(tag);
      kEmbeddingBackward<T>.run(g.device(), dw.data<T>(), gc.data<T>(), idx.data<int64_t>(),
                                idx.numel(), vocab, dim);
    });
    return {dw};
  }
  void release_saved() override { index.reset(); }
};

// ---- layer norm ----

struct LayerNormBackward final : Node {
  SavedTensor x, weight, mean, rstd;
  const char* name() const override { return "LayerNormBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    const Tensor xv = x.get(), wv = weight.get(), mv = mean.get(), rv = rstd.get();
    const Tensor gc = g.contiguous();
    const int64_t cols = xv.size(-1), rows = xv.numel() / std::max<int64_t>(cols, 1);
    Tensor dx = empty(xv.sizes(), xv.options());
    Tensor dw = empty({cols}, xv.options()), db = empty({cols}, xv.options());
    Tensor work = empty({kernels::layer_norm_backward_workspace(rows, cols)}, xv.options());
    detail::dispatch_floating(g.dtype(), "layer_norm backward", [&](auto tag) {
      using T = decltype(tag);
      kLayerNormBackward<T>.run(g.device(), dx.data<T>(), dw.data<T>(), db.data<T>(),
                                work.data<T>(), gc.data<T>(), xv.data<T>(), wv.data<T>(),
                                mv.data<T>(), rv.data<T>(), rows, cols);
    });
    return {dx, dw, db};
  }
  void release_saved() override {
    x.reset();
    weight.reset();
    mean.reset();
    rstd.reset();
  }
};

// ---- attention ----

struct AttentionBackward final : Node {
  SavedTensor q, k, v, o, lse;
  bool causal = true;
  bool mixed = false;  // autocast: the bfloat16 tensor-core kernels
  const char* name() const override { return "ScaledDotProductAttentionBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    const Tensor qv = q.get(), kv = k.get(), vv = v.get(), ov = o.get(), lv = lse.get();
    const Tensor gc = g.contiguous();
    const int64_t t = qv.size(2), d = qv.size(3), heads = qv.size(0) * qv.size(1);
    Tensor dq = empty(qv.sizes(), qv.options()), dk = empty(qv.sizes(), qv.options()),
           dv = empty(qv.sizes(), qv.options());
    Tensor work = empty({kernels::attention_backward_workspace(heads, t)}, qv.options());
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    if (mixed) {
      LEASEHOLD_CUDA_OR("scaled_dot_product_attention",
                        kernels::cuda::attention_backward_bf16(
                            stream_for(g.device()), dq.data<float>(), dk.data<float>(),
                            dv.data<float>(), work.data<float>(), gc.data<float>(),
                            qv.data<float>(), kv.data<float>(), vv.data<float>(),
                            ov.data<float>(), lv.data<float>(), heads, t, d, scale, causal));
      return {dq, dk, dv};
    }
    detail::dispatch_floating(g.dtype(), "scaled_dot_product_attention backward", [&](auto tag) {
      using T = decltype(tag);
      kAttentionBackward<T>.run(g.device(), dq.data<T>(), dk.data<T>(), dv.data<T>(),
                                work.data<T>(), gc.data<T>(), qv.data<T>(), kv.data<T>(),
                                vv.data<T>(), ov.data<T>(), lv.data<T>(), heads, t, d, scale,
                                causal);
    });
    return {dq, dk, dv};
  }
  void release_saved() override {
    q.reset();
    k.reset();
    v.reset();
    o.reset();
    lse.reset();
  }
};

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& index) {
  detail::check_defined(weight, "embedding", "weight");
  detail::check_defined(index, "embedding", "index");
  if (weight.dim() != 2) {
    throw std::invalid_argument("embedding: weight must be [vocab, dim], got " +
                                weight.shape_str());
  }
  if (index.dtype() != DType::Int64) {
    throw std::invalid_argument(std::string("embedding: index must be int64, got ") +
                                dtype_name(index.dtype()));
  }
  if (index.device() != weight.device()) {
    throw std::invalid_argument("embedding: index on " + index.device().str() + ", weight on " +
                                weight.device().str());
  }
  const int64_t vocab = weight.size(0), dim = weight.size(1);
  const Tensor w = weight.contiguous();
  const Tensor idx = index.contiguous();
  if (!idx.device().is_cuda()) {
    const int64_t* p = idx.data<int64_t>();
    for (int64_t i = 0; i < idx.numel(); ++i) {
      if (p[i] < 0 || p[i] >= vocab) {
        throw std::invalid_argument("embedding: index " + std::to_string(p[i]) +
                                    " out of range for a vocabulary of " +
                                    std::to_string(vocab));
      }
    }
  }
  Shape out_shape = index.sizes();
  out_shape.push_back(dim);
  Tensor out = empty(out_shape, weight.options());
  detail::dispatch_floating(weight.dtype(), "embedding", [&](auto tag) {
    using T = decltype(tag);
    kEmbeddingForward<T>.run(weight.device(), out.data<T>(), w.data<T>(), idx.data<int64_t>(),
                             idx.numel(), vocab, dim);
  });
  if (any_requires_grad({&weight})) {
    auto node = std::make_shared<EmbeddingBackward>();
    node->index = SavedTensor(idx);
    node->vocab = vocab;
    node->dim = dim;
    record(out, node, {&weight});
  }
  return out;
}

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps) {
  detail::check_defined(x, "layer_norm", "input");
  detail::check_defined(weight, "layer_norm", "weight");
  detail::check_defined(bias, "layer_norm", "bias");
  detail::check_same(x, weight, "layer_norm");
  detail::check_same(x, bias, "layer_norm");
  if (x.dim() < 1) throw std::invalid_argument("layer_norm: input needs at least 1 dimension");
  const int64_t cols = x.size(-1);
  if (weight.sizes() != Shape{cols} || bias.sizes() != Shape{cols}) {
    throw std::invalid_argument("layer_norm: weight " + weight.shape_str() + " and bias " +
                                bias.shape_str() + " must be [" + std::to_string(cols) +
                                "] for input " + x.shape_str());
  }
  if (!(eps > 0)) throw std::invalid_argument("layer_norm: eps must be positive");
  const Tensor xc = x.contiguous(), wc = weight.contiguous(), bc = bias.contiguous();
  const int64_t rows = cols ? x.numel() / cols : 0;
  Shape stat_shape(x.sizes().begin(), x.sizes().end() - 1);
  Tensor y = empty(x.sizes(), x.options());
  Tensor mean = empty(stat_shape, x.options()), rstd = empty(stat_shape, x.options());
  detail::dispatch_floating(x.dtype(), "layer_norm", [&](auto tag) {
    using T = decltype(tag);
    kLayerNormForward<T>.run(x.device(), y.data<T>(), mean.data<T>(), rstd.data<T>(),
                             xc.data<T>(), wc.data<T>(), bc.data<T>(), rows, cols, eps);
  });
  if (any_requires_grad({&x, &weight, &bias})) {
    auto node = std::make_shared<LayerNormBackward>();
    node->x = SavedTensor(xc);
    node->weight = SavedTensor(wc);
    node->mean = SavedTensor(mean);
    node->rstd = SavedTensor(rstd);
    record(y, node, {&x, &weight, &bias});
  }
  return y;
}

Tensor scaled_dot_product_attention(const Tensor& q, const Tensor& k, const Tensor& v,
                                    bool causal) {
  const char* op = "scaled_dot_product_attention";
  detail::check_defined(q, op, "query");
  detail::check_defined(k, op, "key");
  detail::check_defined(v, op, "value");
  detail::check_same(q, k, op);
  detail::check_same(q, v, op);
  if (q.dim() != 4 || k.sizes() != q.sizes() || v.sizes() != q.sizes()) {
    throw std::invalid_argument(std::string(op) +
                                ": query, key and value must be [batch, heads, tokens, head "
                                "size] of one shape, got " +
                                q.shape_str() + ", " + k.shape_str() + " and " + v.shape_str());
  }
  const int64_t heads = q.size(0) * q.size(1), t = q.size(2), d = q.size(3);
  if (d == 0) throw std::invalid_argument(std::string(op) + ": head size 0");
#ifdef LEASEHOLD_HAVE_CUDA
  if (q.device().is_cuda() && d > kernels::cuda::kMaxCudaHeadSize) {
    throw std::invalid_argument(std::string(op) + ": head size " + std::to_string(d) +
                                " is over the " + std::to_string(kernels::cuda::kMaxCudaHeadSize) +
                                " the CUDA kernel takes");
  }
#endif
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  Tensor o = empty(q.sizes(), q.options());
  Tensor lse = empty({q.size(0), q.size(1), t}, q.options());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // Autocast (CUDA only): the products in bfloat16 on tensor cores.
  const bool mixed =
      autocast_dtype(q.device()) == DType::BFloat16 && q.dtype() == DType::Float32;
  if (mixed) {
    LEASEHOLD_CUDA_OR(op, kernels::cuda::attention_forward_bf16(
                              stream_for(q.device()), o.data<float>(), lse.data<float>(),
                              qc.data<float>(), kc.data<float>(), vc.data<float>(), heads, t, d,
                              scale, causal));
  } else {
    detail::dispatch_floating(q.dtype(), op, [&](auto tag) {
      using T = decltype(tag);
      kAttentionForward<T>.run(q.device(), o.data<T>(), lse.data<T>(), qc.data<T>(),
                               kc.data<T>(), vc.data<T>(), heads, t, d, scale, causal);
    });
  }
  if (any_requires_grad({&q, &k, &v})) {
    auto node = std::make_shared<AttentionBackward>();
    node->q = SavedTensor(qc);
    node->k = SavedTensor(kc);
    node->v = SavedTensor(vc);
    node->o = SavedTensor(o);
    node->lse = SavedTensor(lse);
    node->causal = causal;
    node->mixed = mixed;
    record(o, node, {&q, &k, &v});
  }
  return o;
}

}  // namespace leasehold::engine
