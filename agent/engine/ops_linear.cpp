// Linear layers: products with a bias, a fused ReLU or GELU, and autocast's
// mixed precision (gemm.h), and their backward.
#include <stdexcept>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/gemm.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/elementwise.h"
#include "kernels/matmul.h"
#include "kernels/reduce.h"

namespace leasehold::engine {
namespace {

using detail::add_gemm_mixed;
using detail::gemm;
using detail::gemm_into;
using detail::gemm_mixed;
using detail::MixedEpilogue;
using detail::MixedProduct;

// The column sums of a bfloat16 [rows, columns] in float32: a bias's
// gradient under autocast (CUDA only). With `gelu_input` defined, the sums
// of GELU's backward of g16 at it, which is written to `gelu_grad` as it
// is summed (one pass for a fused GELU's gradient and its bias's): over
// g16 itself when `in_place` (each element is read before it is written).
// `into` (may be undefined): the bias's gradient so far, to which the sums
// are added and which is returned (autograd.h: gradient_to_add_into).
Tensor column_sums_bf16(const Tensor& g16, const Tensor& into, const Tensor& gelu_input = Tensor(),
                        Tensor* gelu_grad = nullptr, bool in_place = false) {
  const int64_t rows = g16.size(0), columns = g16.size(1);
  const TensorOptions f32{DType::Float32, g16.device()};
  const bool add = into.defined();
  Tensor sums = add ? into : empty({columns}, f32);
#ifdef LEASEHOLD_HAVE_CUDA
  const Tensor work = empty({kernels::cuda::column_sums_bf16_workspace(rows, columns)}, f32);
  const kernels::Stream s = stream_for(g16.device());
  if (gelu_input.defined()) {
    *gelu_grad = in_place ? g16 : empty(g16.sizes(), g16.options());
    kernels::cuda::gelu_backward_column_sums_bf16(
        s, gelu_grad->data<bfloat16>(), sums.data<float>(), work.data<float>(),
        g16.data<bfloat16>(), gelu_input.data<bfloat16>(), rows, columns, add);
  } else {
    kernels::cuda::column_sums_bf16(s, sums.data<float>(), work.data<float>(),
                                    g16.data<bfloat16>(), rows, columns, add);
  }
#else
  (void)rows;
  (void)add;
  (void)gelu_input;
  (void)gelu_grad;
  (void)in_place;
  detail::no_cuda("linear");
#endif
  return sums;
}

struct LinearBackward final : Node {
  SavedTensor x, w;  // contiguous; bfloat16 when `mixed` (x: the input itself if it was)
  SavedTensor y;      // the output, when a ReLU was fused in (its mask)
  SavedTensor gelu_input;  // bfloat16, when a GELU was fused in (`gelu`; mixed only)
  bool relu = false;
  bool gelu = false;
  bool mixed = false;  // autocast: bfloat16 GEMMs
  DType x_dtype = DType::Float32;  // the input's own type, its gradient's
  const char* name() const override { return "LinearBackward"; }
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor X = x.get(), W = w.get(), g = g_in.contiguous();
    const int64_t n = X.size(0), in = X.size(1), out = W.size(0);
    const bool want_b = next.size() > 2 && next[2].fn;
    Tensor gx, gw, gb;
    if (relu) {
      Tensor Y = y.get();
      // relu's gradient and the bias's in one pass (forward only fuses on
      // CUDA, for at most kMaxColumnRows rows).
      Tensor masked = empty(g.sizes(), g.options());
      gb = empty({out}, g.options());
      detail::dispatch_floating(g.dtype(), "linear backward", [&](auto tag) {
        using T = decltype(tag);
        [[maybe_unused]] const kernels::ColumnSums<T> s{.out = gb.data<T>(),
                                                        .in = g.data<T>(),
                                                        .rows = n,
                                                        .columns = out,
                                                        .mask = Y.data<T>(),
                                                        .masked = masked.data<T>()};
        LEASEHOLD_CUDA_OR("linear", kernels::cuda::sum_columns<T>(stream_for(g.device()), s));
      });
      g = masked;
      if (!want_b) gb = Tensor();
    }
    if (mixed) {
      // The products read g in bfloat16: GELU's gradient is written so.
      // (The bias gradient first, as below. cuBLASLt's BGRADB epilogue ran
      // it as a kernel of its own at under half the memory bandwidth; with
      // a GELU, its gradient and the bias's are one pass.)
      Tensor g16;
      // (The bias's gradient added to its sum so far where that may take
      // it, as the weight's below.)
      const Tensor b_into =
          want_b ? gradient_to_add_into(next[2].fn, {out}, DType::Float32) : Tensor();
      if (gelu) {
        const Tensor a = gelu_input.get(), g_bf = g.to(DType::BFloat16);
        // GELU's gradient goes over g_bf where nothing else reads it: a
        // conversion or copy of our own, or the engine's gradient when it
        // is ours alone (fc1's under autocast: 4 × dim × tokens bfloat16
        // values less at the peak of an MLP's backward).
        const bool ours =
            grad_output_owned || g_bf.impl()->storage != g_in.impl()->storage;
        if (want_b && !gb.defined()) {
          gb = column_sums_bf16(g_bf, b_into, a, &g16, ours);
        } else {
          g16 = ours ? g_bf : empty(a.sizes(), a.options());
          LEASEHOLD_CUDA_OR("linear",
                            kernels::cuda::gelu_backward_bf16(
                                stream_for(a.device()), g16.data<bfloat16>(),
                                g_bf.data<bfloat16>(), a.data<bfloat16>(), a.numel()));
        }
      } else {
        g16 = g.to(DType::BFloat16);
      }
      if (want_b && !gb.defined()) gb = column_sums_bf16(g16, b_into);
      if (next[1].fn) {
        // (Added by the product where the weight's gradient so far may
        // take it: a recomputed MLP's slice after the first, recompute.h,
        // or any backward before the gradients are zeroed.)
        gw = gradient_to_add_into(next[1].fn, W.sizes(), DType::Float32);
        if (gw.defined()) {
          add_gemm_mixed(gw, g16, true, X, false, out, in, n);
        } else {
          gw = gemm_mixed(g16, true, X, false, out, in, n, W.sizes(), DType::Float32).out;
        }
      }
      const Shape x_sizes = X.sizes();
      let_input_go(X);
      if (next[0].fn) gx = gemm_mixed(g16, false, W, false, n, in, out, x_sizes, x_dtype).out;
      return {gx, gw, gb};
    }
    // (The bias sum first: its scratch is gone before the products' outputs
    // exist, which keeps the step's peak lower under a tight budget.)
    if (want_b && !gb.defined()) gb = sum(g, {0});
    if (next[1].fn) {
      gw = gradient_to_add_into(next[1].fn, W.sizes(), W.dtype());
      if (gw.defined()) {
        gemm_into(gw, 1.0, g, true, X, false, 1, out, in, n, false, false);
      } else {
        gw = gemm(g, true, X, false, 1, out, in, n, false, false, W.sizes());
      }
    }
    const Shape x_sizes = X.sizes();
    let_input_go(X);
    if (next[0].fn) gx = gemm(g, false, W, false, 1, n, in, out, false, false, x_sizes);
    return {gx, gw, gb};
  }
  // The weight's gradient is made first, so that the input, read by it
  // alone, goes before its gradient, of its size, is made (a GPT MLP's fc2:
  // its input is the GELU's output, 4 × dim × tokens bfloat16 values off
  // the peak of the MLP's backward), where nothing else holds it and the
  // graph is not retained. The same bits as in the other order.
  void let_input_go(Tensor& X) {
    X = Tensor();
    if (saved_released_after) x.reset();
  }
  void release_saved() override {
    x.reset();
    w.reset();
    y.reset();
    gelu_input.reset();
  }
};

// Under autocast, an input already in bfloat16 (a product's output kept so
// for the next one) is read as it is; otherwise inputs are float32 and
// match the weight's type.
bool autocast_linear(const Tensor& x, const Tensor& w) {
  return autocast_dtype(x.device()) == DType::BFloat16 && w.dtype() == DType::Float32 &&
         (x.dtype() == DType::Float32 || x.dtype() == DType::BFloat16);
}

// The checks every linear layer makes: shapes, and the bias's.
void check_linear(const Tensor& x_in, const Tensor& w_in, const Tensor& bias, const char* op) {
  detail::check_defined(x_in, op, "input");
  detail::check_defined(w_in, op, "weight");
  if (!(x_in.dtype() == DType::BFloat16 && autocast_linear(x_in, w_in))) {
    detail::check_same(x_in, w_in, op);
  } else if (x_in.device() != w_in.device()) {
    throw std::invalid_argument(std::string(op) + ": devices differ (" + x_in.device().str() +
                                " and " + w_in.device().str() + ")");
  }
  if (x_in.dim() != 2 || w_in.dim() != 2 || x_in.size(1) != w_in.size(1)) {
    throw std::invalid_argument(std::string(op) + ": input " + x_in.shape_str() + " and weight " +
                                w_in.shape_str() + " do not fit ([N, in] and [out, in])");
  }
  if (bias.defined()) {
    detail::check_same(w_in, bias, op);
    if (bias.dim() != 1 || bias.size(0) != w_in.size(0)) {
      throw std::invalid_argument(std::string(op) + ": bias " + bias.shape_str() + " for " +
                                  std::to_string(w_in.size(0)) + " outputs");
    }
  }
}

}  // namespace

Tensor linear(const Tensor& x_in, const Tensor& w_in, const Tensor& bias, bool then_relu,
              ProductOut product_out) {
  check_linear(x_in, w_in, bias, "linear");
  const int64_t n = x_in.size(0), in = x_in.size(1), out_features = w_in.size(0);
  const bool cuda = x_in.device().is_cuda();
  if (then_relu && !(cuda && n <= kernels::kMaxColumnRows)) {
    Tensor product;
    {
      OutputsUnreadGuard read(false);  // (relu reads it)
      product = linear(x_in, w_in, bias, false, ProductOut::Float32);
    }
    return relu(product);
  }
  // Autocast: the GEMM in bfloat16 (the copies are what backward keeps).
  const bool mixed = autocast_linear(x_in, w_in);
  // Backward reads a fused ReLU's output; otherwise nothing reads an
  // output made only for its graph (autograd.h: outputs_unread).
  const bool unread = outputs_unread() && !then_relu;
  // (The mixed GEMM makes its own output.)
  Tensor x, w, b, out = mixed ? Tensor() : empty({n, out_features}, x_in.options());
  {
    NoGradGuard no_grad;
    x = x_in.contiguous();
    w = w_in.contiguous();
    if (bias.defined()) b = bias.detach().contiguous();
    // On the CPU the bias goes in first and the GEMM adds to it.
    if (b.defined() && !cuda && !unread) {
      out.copy_(b.reshape({1, out_features}).expand(out.sizes()));
    }
  }
  if (mixed) {
    x = x.to(DType::BFloat16);
    w = autocast_copy(w);
    // A ReLU's output is its backward's mask, kept in float32.
    const DType out_dtype = product_out == ProductOut::LowerPrecision && !then_relu
                                ? DType::BFloat16
                                : DType::Float32;
    if (unread) {
      out = empty({n, out_features}, TensorOptions{out_dtype, x_in.device()});
    } else {
      MixedEpilogue e;
      e.bias = b;
      e.relu = then_relu;
      out = gemm_mixed(x, false, w, true, n, out_features, in, {n, out_features}, out_dtype, e)
                .out;
    }
  } else if (!unread) {
    // out [n, out] = x [n, in] · wᵀ, w read as stored ([out, in]).
    gemm_into(out, b.defined() && !cuda ? 1.0 : 0.0, x, false, w, true, 1, n, out_features, in,
              false, false);
    if (cuda && (b.defined() || then_relu)) {
      detail::dispatch_floating(out.dtype(), "linear", [&](auto tag) {
        using T [[maybe_unused]] = decltype(tag);
        LEASEHOLD_CUDA_OR("linear", kernels::cuda::bias_activation<T>(
                                        stream_for(out.device()), out.data<T>(),
                                        b.defined() ? b.data<T>() : nullptr, n, out_features,
                                        then_relu));
      });
    }
  }
  if (any_requires_grad({&x_in, &w_in, &bias})) {
    auto node = std::make_shared<LinearBackward>();
    node->x = SavedTensor(x);
    node->w = SavedTensor(w);
    node->mixed = mixed;
    node->x_dtype = x_in.dtype();
    if (then_relu) {
      node->y = SavedTensor(out);
      node->relu = true;
    }
    record(out, node, {&x_in, &w_in, &bias});
  }
  return out;
}

Tensor linear_gelu(const Tensor& x_in, const Tensor& w_in, const Tensor& bias) {
  check_linear(x_in, w_in, bias, "linear_gelu");
  if (!autocast_linear(x_in, w_in)) {
    Tensor product;
    {
      OutputsUnreadGuard read(false);  // (gelu reads it)
      product = linear(x_in, w_in, bias);
    }
    return gelu(product);
  }
  const int64_t n = x_in.size(0), in = x_in.size(1), out_features = w_in.size(0);
  Tensor x, w;
  MixedEpilogue e;
  e.gelu = true;
  {
    NoGradGuard no_grad;
    x = x_in.contiguous().to(DType::BFloat16);
    w = autocast_copy(w_in.contiguous());
    if (bias.defined()) e.bias = bias.detach().contiguous();
  }
  MixedProduct p =
      gemm_mixed(x, false, w, true, n, out_features, in, {n, out_features}, DType::BFloat16, e);
  if (any_requires_grad({&x_in, &w_in, &bias})) {
    auto node = std::make_shared<LinearBackward>();
    node->x = SavedTensor(x);
    node->w = SavedTensor(w);
    node->gelu_input = SavedTensor(p.gelu_input);
    node->gelu = true;
    node->mixed = true;
    node->x_dtype = x_in.dtype();
    record(p.out, node, {&x_in, &w_in, &bias});
  }
  return p.out;
}

}  // namespace leasehold::engine
