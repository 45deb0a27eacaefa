// Transformer operators: embedding, layer norm and fused attention. Each
// picks its kernel from a KernelTable by the tensors' device.
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/embedding.h"
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
    Tensor work;  // (CUDA's sort and partial sums; from the job's memory)
#ifdef LEASEHOLD_HAVE_CUDA
    if (g.device().is_cuda()) {
      const size_t bytes = kernels::cuda::embedding_backward_workspace(idx.numel(), vocab, dim,
                                                                       dtype_size(g.dtype()));
      if (bytes) work = empty({static_cast<int64_t>((bytes + 7) / 8)}, {DType::Int64, g.device()});
    }
#endif
    detail::dispatch_floating(g.dtype(), "embedding backward", [&](auto tag) {
      using T = decltype(tag);
      kEmbeddingBackward<T>.run(g.device(), dw.data<T>(), gc.data<T>(), idx.data<int64_t>(),
                                idx.numel(), vocab, dim,
                                work.defined() ? work.data<int64_t>() : nullptr);
    });
    return {dw};
  }
  void release_saved() override { index.reset(); }
};

// ---- layer norm ----

struct LayerNormBackward final : Node {
  SavedTensor x, weight, mean, rstd;
  Shape x_sizes;
  TensorOptions x_options;
  Tensor plus;  // x's gradient from its other consumers, taken to add to dx
  const char* name() const override { return "LayerNormBackward"; }
  // (x's other gradient must be of x's type and shape, contiguous: a
  // residual stream's, which its addition passed on as it came; and
  // 16-byte aligned, so that it never decides which kernel runs, whose
  // roundings differ: the sum stays the bits of the addition after.)
  bool fold_into_input0(const Tensor& sum) override {
    if (sum.dtype() != x_options.dtype || sum.device() != x_options.device ||
        sum.sizes() != x_sizes || !sum.is_contiguous() ||
        reinterpret_cast<uintptr_t>(sum.raw_data()) % 16 != 0) {
      return false;
    }
    plus = sum;
    return true;
  }
  std::vector<Tensor> apply(const Tensor& g) override {
    const Tensor p = std::move(plus);  // (taken for this call only, whatever happens)
    const Tensor xv = x.get(), wv = weight.get(), mv = mean.get(), rv = rstd.get();
    const Tensor gc = g.contiguous();
    const int64_t cols = xv.size(-1), rows = xv.numel() / std::max<int64_t>(cols, 1);
    // Over the sum so far where it is ours alone (each element is read
    // before it is written): a residual stream's gradient, 24 MiB a GPT
    // block, not made twice; and a recomputed MLP's slice, written where
    // its segment gathers its input's gradient (recompute.cpp), not copied
    // there after.
    Tensor dx = p.defined() && sum_so_far_owned ? p : empty(xv.sizes(), xv.options());
    Tensor work = empty({kernels::layer_norm_backward_workspace(rows, cols)}, xv.options());
    if (gc.dtype() == DType::BFloat16) {
      // (A bfloat16 output's gradient: the product that read it wrote it
      // so. The weight's and bias's gradients are added to their sums so
      // far where those may take them: a slice after the first of a
      // recomputed MLP, autograd.h: gradient_to_add_into.)
      Tensor dw = next.size() > 1 ? gradient_to_add_into(next[1].fn, {cols}, DType::Float32)
                                  : Tensor();
      Tensor db = next.size() > 2 ? gradient_to_add_into(next[2].fn, {cols}, DType::Float32)
                                  : Tensor();
      const bool add_dw = dw.defined(), add_db = db.defined();
      if (!add_dw) dw = empty({cols}, xv.options());
      if (!add_db) db = empty({cols}, xv.options());
      LEASEHOLD_CUDA_OR("layer_norm backward",
                        kernels::cuda::layer_norm_backward_bf16(
                            stream_for(g.device()), dx.data<float>(),
                            p.defined() ? p.data<float>() : nullptr, dw.data<float>(),
                            db.data<float>(), work.data<float>(), gc.data<bfloat16>(),
                            xv.data<float>(), wv.data<float>(), mv.data<float>(),
                            rv.data<float>(), rows, cols, add_dw, add_db));
      return {dx, dw, db};
    }
    Tensor dw = empty({cols}, xv.options()), db = empty({cols}, xv.options());
    detail::dispatch_floating(g.dtype(), "layer_norm backward", [&](auto tag) {
      using T = decltype(tag);
      kLayerNormBackward<T>.run(g.device(), dx.data<T>(), p.defined() ? p.data<T>() : nullptr,
                                dw.data<T>(), db.data<T>(), work.data<T>(), gc.data<T>(),
                                xv.data<T>(), wv.data<T>(), mv.data<T>(), rv.data<T>(), rows,
                                cols);
    });
    return {dx, dw, db};
  }
  void release_saved() override {
    x.reset();
    weight.reset();
    mean.reset();
    rstd.reset();
    plus = Tensor();
  }
};

// ---- attention ----

// Attention's operands: q, k and v at element offsets into the tensors that
// hold them (one tensor for all three when they are read in place from a
// fused projection), their rows placed as `layout` says.
struct AttentionArgs {
  kernels::AttentionLayout layout;
  int64_t q_at = 0, k_at = 0, v_at = 0;
  int64_t heads = 0, t = 0, d = 0;  // heads: batch × heads
  bool causal = true;
  bool mixed = false;  // autocast: the bfloat16 tensor-core kernels
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(d)); }
};

// Calls f with a float or bfloat16 tag for the activations of the mixed
// (autocast) kernels.
template <class F>
void dispatch_mixed(DType dtype, F&& f) {
  if (dtype == DType::BFloat16) {
    f(bfloat16{});
  } else {
    f(float{});
  }
}

void attention_forward(const AttentionArgs& a, const Tensor& q, const Tensor& k, const Tensor& v,
                       Tensor& o, Tensor& lse, const char* op) {
  if (a.mixed) {
    dispatch_mixed(q.dtype(), [&](auto tag) {
      using T [[maybe_unused]] = decltype(tag);
      LEASEHOLD_CUDA_OR(op, kernels::cuda::attention_forward_bf16<T>(
                                stream_for(q.device()), o.data<T>(), lse.data<float>(),
                                q.data<T>() + a.q_at, k.data<T>() + a.k_at, v.data<T>() + a.v_at,
                                a.layout, a.heads, a.t, a.d, a.scale(), a.causal));
    });
    return;
  }
  detail::dispatch_floating(q.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    kAttentionForward<T>.run(q.device(), o.data<T>(), lse.data<T>(), q.data<T>() + a.q_at,
                             k.data<T>() + a.k_at, v.data<T>() + a.v_at, a.layout, a.heads, a.t,
                             a.d, a.scale(), a.causal);
  });
}

// dq, dk and dv written at the same offsets into dq_in, dk_in and dv_in as q,
// k and v have in theirs.
void attention_backward(const AttentionArgs& a, const Tensor& g, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& o, const Tensor& lse,
                        Tensor& dq_in, Tensor& dk_in, Tensor& dv_in, const char* op) {
  Tensor work = empty({kernels::attention_backward_workspace(a.heads, a.t)}, lse.options());
  if (a.mixed) {
    dispatch_mixed(q.dtype(), [&](auto tag) {
      using T [[maybe_unused]] = decltype(tag);
      // (The gradient arrives in the output's type: a product's backward
      // writes it so.)
      const Tensor gt = g.to(q.dtype());
      LEASEHOLD_CUDA_OR(op, kernels::cuda::attention_backward_bf16<T>(
                                stream_for(g.device()), dq_in.data<T>() + a.q_at,
                                dk_in.data<T>() + a.k_at, dv_in.data<T>() + a.v_at,
                                work.data<float>(), gt.data<T>(), q.data<T>() + a.q_at,
                                k.data<T>() + a.k_at, v.data<T>() + a.v_at, o.data<T>(),
                                lse.data<float>(), a.layout, a.heads, a.t, a.d, a.scale(),
                                a.causal));
    });
    return;
  }
  detail::dispatch_floating(g.dtype(), op, [&](auto tag) {
    using T = decltype(tag);
    kAttentionBackward<T>.run(g.device(), dq_in.data<T>() + a.q_at, dk_in.data<T>() + a.k_at,
                              dv_in.data<T>() + a.v_at, work.data<T>(), g.data<T>(),
                              q.data<T>() + a.q_at, k.data<T>() + a.k_at, v.data<T>() + a.v_at,
                              o.data<T>(), lse.data<T>(), a.layout, a.heads, a.t, a.d,
                              a.scale(), a.causal);
  });
}

struct AttentionBackward final : Node {
  SavedTensor q, k, v, o, lse;  // contiguous
  AttentionArgs args;
  const char* name() const override { return "ScaledDotProductAttentionBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    const Tensor qv = q.get(), kv = k.get(), vv = v.get();
    Tensor dq = empty(qv.sizes(), qv.options()), dk = empty(qv.sizes(), qv.options()),
           dv = empty(qv.sizes(), qv.options());
    attention_backward(args, g.contiguous(), qv, kv, vv, o.get(), lse.get(), dq, dk, dv,
                       "scaled_dot_product_attention backward");
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

// q, k and v read in place from the fused projection, their gradients
// written into one tensor of its shape.
struct SelfAttentionBackward final : Node {
  SavedTensor qkv, o, lse;  // contiguous
  AttentionArgs args;
  const char* name() const override { return "SelfAttentionBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    const Tensor x = qkv.get();
    Tensor dx = empty(x.sizes(), x.options());  // every element written
    attention_backward(args, g.contiguous(), x, x, x, o.get(), lse.get(), dx, dx, dx,
                       "self_attention backward");
    return {dx};
  }
  void release_saved() override {
    qkv.reset();
    o.reset();
    lse.reset();
  }
};

void check_head_size(const Tensor& like, int64_t d, const char* op) {
  if (d == 0) throw std::invalid_argument(std::string(op) + ": head size 0");
#ifdef LEASEHOLD_HAVE_CUDA
  if (like.device().is_cuda() && d > kernels::cuda::kMaxCudaHeadSize) {
    throw std::invalid_argument(std::string(op) + ": head size " + std::to_string(d) +
                                " is over the " + std::to_string(kernels::cuda::kMaxCudaHeadSize) +
                                " the CUDA kernel takes");
  }
#else
  (void)like;
#endif
}

// Autocast (CUDA only): the products in bfloat16 on tensor cores, for
// float32 activations or bfloat16 ones (a projection's output kept so:
// ProductOut::LowerPrecision), which the output then matches. Without
// autocast bfloat16 is refused as every operator refuses it.
bool autocast_attention(const Tensor& like) {
  return autocast_dtype(like.device()) == DType::BFloat16 &&
         (like.dtype() == DType::Float32 || like.dtype() == DType::BFloat16);
}

// The softmax statistics' type: float32 for bfloat16 activations.
TensorOptions stats_options(const Tensor& like) {
  return {like.dtype() == DType::BFloat16 ? DType::Float32 : like.dtype(), like.device()};
}

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

Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                  ProductOut out) {
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
  // Under autocast, y in bfloat16 when a product is all that reads it.
  const bool lower = out == ProductOut::LowerPrecision && x.dtype() == DType::Float32 &&
                     autocast_dtype(x.device()) == DType::BFloat16;
  Tensor y = empty(x.sizes(), {lower ? DType::BFloat16 : x.dtype(), x.device()});
  Tensor mean = empty(stat_shape, x.options()), rstd = empty(stat_shape, x.options());
  if (lower) {
    LEASEHOLD_CUDA_OR("layer_norm", kernels::cuda::layer_norm_forward_bf16(
                                        stream_for(x.device()), y.data<bfloat16>(),
                                        mean.data<float>(), rstd.data<float>(), xc.data<float>(),
                                        wc.data<float>(), bc.data<float>(), rows, cols, eps));
  } else {
    detail::dispatch_floating(x.dtype(), "layer_norm", [&](auto tag) {
      using T = decltype(tag);
      kLayerNormForward<T>.run(x.device(), y.data<T>(), mean.data<T>(), rstd.data<T>(),
                               xc.data<T>(), wc.data<T>(), bc.data<T>(), rows, cols, eps);
    });
  }
  if (any_requires_grad({&x, &weight, &bias})) {
    auto node = std::make_shared<LayerNormBackward>();
    node->x = SavedTensor(xc);
    node->x_sizes = xc.sizes();
    node->x_options = xc.options();
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
  AttentionArgs a;
  a.heads = q.size(0) * q.size(1);
  a.t = q.size(2);
  a.d = q.size(3);
  check_head_size(q, a.d, op);
  a.layout = kernels::contiguous_attention(q.size(1), a.t, a.d);
  a.causal = causal;
  a.mixed = autocast_attention(q);
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  Tensor o = empty(q.sizes(), q.options());
  Tensor lse = empty({q.size(0), q.size(1), a.t}, stats_options(q));
  attention_forward(a, qc, kc, vc, o, lse, op);
  if (any_requires_grad({&q, &k, &v})) {
    auto node = std::make_shared<AttentionBackward>();
    node->q = SavedTensor(qc);
    node->k = SavedTensor(kc);
    node->v = SavedTensor(vc);
    node->o = SavedTensor(o);
    node->lse = SavedTensor(lse);
    node->args = a;
    record(o, node, {&q, &k, &v});
  }
  return o;
}

namespace {

// self_attention's operands, checked; `kept` null for the plain operator.
Tensor self_attention_kept(const Tensor& qkv, int64_t heads, bool causal, KeptAttention* kept) {
  const char* op = "self_attention";
  detail::check_defined(qkv, op, "qkv");
  if (qkv.dim() != 3 || heads < 1 || qkv.size(2) % (3 * heads) != 0) {
    throw std::invalid_argument(std::string(op) + ": qkv must be [batch, tokens, 3 × heads × " +
                                "head size] for " + std::to_string(heads) + " heads, got " +
                                qkv.shape_str());
  }
  const int64_t b = qkv.size(0), c = qkv.size(2) / 3;
  AttentionArgs a;
  a.heads = b * heads;
  a.t = qkv.size(1);
  a.d = c / heads;
  check_head_size(qkv, a.d, op);
  a.layout = kernels::packed_attention(heads, a.t, a.d);
  a.k_at = c;
  a.v_at = 2 * c;
  a.causal = causal;
  a.mixed = autocast_attention(qkv);
  const Tensor x = qkv.contiguous();
  const Shape o_shape{b, a.t, c}, lse_shape{b, heads, a.t};
  const bool run_again = kept && kept->filled;  // on the first run's kept output
  Tensor o, lse;
  if (run_again) {
    // (Detached again: the kept tensors go to the node as they are saved,
    // and the output it is recorded on must be another tensor.)
    o = kept->o.get().detach();
    lse = kept->lse.get().detach();
    const TensorOptions stats = stats_options(qkv);
    if (o.sizes() != o_shape || o.dtype() != qkv.dtype() || o.device() != qkv.device() ||
        lse.sizes() != lse_shape || lse.dtype() != stats.dtype || lse.device() != stats.device) {
      throw std::logic_error(std::string(op) + ": the output kept from the first run is " +
                             o.shape_str() + " " + dtype_name(o.dtype()) + " on " +
                             o.device().str() + ", not the " + shape_to_string(o_shape) + " " +
                             dtype_name(qkv.dtype()) + " on " + qkv.device().str() +
                             " that qkv " + qkv.shape_str() + " gives");
    }
  } else {
    o = empty(o_shape, qkv.options());
    lse = empty(lse_shape, stats_options(qkv));
    attention_forward(a, x, x, x, o, lse, op);
  }
  if (any_requires_grad({&qkv})) {
    auto node = std::make_shared<SelfAttentionBackward>();
    node->qkv = SavedTensor(x);
    if (run_again) {
      node->o = std::move(kept->o);
      node->lse = std::move(kept->lse);
    } else {
      node->o = SavedTensor(o);
      node->lse = SavedTensor(lse);
    }
    node->args = a;
    record(o, node, {&qkv});
  }
  if (run_again) {
    *kept = KeptAttention{};
  } else if (kept && !grad_enabled()) {
    // (Kept by the segment's first run only, which records nothing: a run
    // with gradients, the segment's plain one outside a StepRandom or a
    // second backward's, keeps its output in its node as ever.)
    kept->o = SavedTensor(o);
    kept->lse = SavedTensor(lse);
    kept->filled = true;
  }
  return o;
}

}  // namespace

Tensor self_attention(const Tensor& qkv, int64_t heads, bool causal) {
  return self_attention_kept(qkv, heads, causal, nullptr);
}

Tensor self_attention(const Tensor& qkv, int64_t heads, bool causal, KeptAttention& kept) {
  return self_attention_kept(qkv, heads, causal, &kept);
}

}  // namespace leasehold::engine
