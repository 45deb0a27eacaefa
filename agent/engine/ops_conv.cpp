// conv2d (direct kernels for small shapes on CUDA, else im2col + GEMM),
// max_pool2d and dropout.
#include <algorithm>
#include <stdexcept>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/gemm.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/conv.h"
#include "kernels/elementwise.h"
#include "kernels/reduce.h"

namespace leasehold::engine {
namespace {

// The kernels both backends have; the direct convolution kernels and the
// disjoint pooling gradient are CUDA's fast paths, chosen by plan.
template <class T>
const auto kIm2col = LEASEHOLD_KERNEL_TABLE("conv2d", im2col, T);
template <class T>
const auto kCol2im = LEASEHOLD_KERNEL_TABLE("conv2d", col2im, T);
template <class T>
const auto kMaxPool = LEASEHOLD_KERNEL_TABLE("max_pool2d", max_pool, T);
template <class T>
const auto kMaxPoolBackward = LEASEHOLD_KERNEL_TABLE("max_pool2d", max_pool_backward, T);
template <class T>
const auto kDropout = LEASEHOLD_KERNEL_TABLE("dropout", dropout, T);

kernels::ConvGeometry geometry(const Tensor& x, const Tensor& w, int64_t stride, int64_t pad) {
  kernels::ConvGeometry g;
  g.n = x.size(0);
  g.c = x.size(1);
  g.h = x.size(2);
  g.w = x.size(3);
  g.kh = w.size(2);
  g.kw = w.size(3);
  g.stride = stride;
  g.pad = pad;
  return g;
}

// im2col needs C·KH·KW·OH·OW elements per image (nine times a 3×3
// convolution's input): done for the whole batch at once it would dominate
// a job's peak memory, so images go through in chunks (ops.h).
thread_local int64_t t_column_bytes = 32ll << 20;

int64_t images_per_chunk(int64_t bytes_per_image, int64_t n) {
  return std::clamp<int64_t>(t_column_bytes / std::max<int64_t>(1, bytes_per_image), 1,
                             std::max<int64_t>(1, n));
}

// Geometry of images [n0, n0 + count) of `g`.
kernels::ConvGeometry chunk_of(kernels::ConvGeometry g, int64_t count) {
  g.n = count;
  return g;
}

template <class T>
void run_gemm(const Tensor& like, const kernels::GemmShape& s, const T* a, const T* b, T* c,
              T beta = T(0)) {
  detail::gemm<T>(like.device(), s, T(1), a, b, beta, c);
}

// The direct kernels' side of conv2d's backward (kernels/conv.h): the input
// gradient in one launch; the weight and bias gradients in partial sums
// (per group of images and slice of rows; at most kMaxColumnRows of them,
// kernels/conv_plan.cpp), then summed into buffers of their own. `mask`: a
// fused ReLU's output, or undefined.
template <class T>
void direct_backward(const Tensor& X, const Tensor& W, [[maybe_unused]] const Tensor& g,
                     const Tensor& mask, const kernels::ConvGeometry& geo,
                     const kernels::DirectConvPlan& plan, bool want_x, bool want_w, bool want_b,
                     Tensor& gx, Tensor& gw, Tensor& gb) {
  const int64_t O = W.size(0), CKK = geo.c * geo.kh * geo.kw;
  [[maybe_unused]] const T* m = mask.defined() ? mask.data<T>() : nullptr;
  if (want_x) {
    gx = empty(X.sizes(), X.options());
    LEASEHOLD_CUDA_OR("conv2d", kernels::cuda::conv2d_direct_backward_input<T>(
                                    stream_for(X.device()), gx.data<T>(), g.data<T>(), m,
                                    W.data<T>(), geo, O, plan));
  }
  if (!want_w && !want_b) return;
  Tensor partial = empty({plan.partial_rows(), O * CKK + O}, X.options());
  LEASEHOLD_CUDA_OR("conv2d", kernels::cuda::conv2d_direct_backward_weight<T>(
                                  stream_for(X.device()), partial.data<T>(), X.data<T>(),
                                  g.data<T>(), m, geo, O, plan));
  gw = empty(W.sizes(), W.options());
  gb = empty({O}, W.options());
  [[maybe_unused]] const kernels::ColumnSums<T> s{.out = gw.data<T>(),
                                                  .in = partial.data<T>(),
                                                  .rows = plan.partial_rows(),
                                                  .columns = O * CKK + O,
                                                  .tail = gb.data<T>(),
                                                  .tail_from = O * CKK};
  LEASEHOLD_CUDA_OR("conv2d", kernels::cuda::sum_columns<T>(stream_for(X.device()), s));
  if (!want_w) gw = Tensor();
  if (!want_b) gb = Tensor();
}

struct Conv2dBackward final : Node {
  SavedTensor x, w;  // contiguous
  SavedTensor y;     // the output, when a ReLU was fused in (direct kernels only)
  bool relu = false;
  int64_t stride = 1, pad = 0;
  const char* name() const override { return "Conv2dBackward"; }
  std::vector<Tensor> apply(const Tensor& grad) override {
    Tensor X = x.get(), W = w.get(), g = grad.contiguous();
    auto geo = geometry(X, W, stride, pad);
    int64_t O = W.size(0), CKK = geo.c * geo.kh * geo.kw, L = geo.oh() * geo.ow();
    const bool want_b = next.size() > 2 && next[2].fn;
    Tensor gx, gw, gb;
    bool direct = false;
    detail::dispatch_floating(X.dtype(), "conv2d backward", [&](auto tag) {
      using T = decltype(tag);
      if (X.device().is_cuda()) {
        const auto plan = kernels::plan_direct_conv(geo, O, sizeof(T));
        if (plan.fits) {
          direct = true;
          direct_backward<T>(X, W, g, relu ? y.get() : Tensor(), geo, plan, bool(next[0].fn),
                             bool(next[1].fn), want_b, gx, gw, gb);
          return;
        }
      }
      // Chunks as in forward (the same GEMM shapes); the per-image weight
      // gradients of a chunk take O·CKK per image beside its columns.
      const int64_t image = geo.c * geo.h * geo.w,
                    nb = images_per_chunk(CKK * L * sizeof(T), geo.n);
      if (next[1].fn) {
        // dW = sum_n g[n] [O, L] · col[n]ᵀ [L, CKK], a chunk of images at a time.
        Tensor col = empty({nb, CKK, L}, X.options());
        Tensor per_image = empty({nb, O, CKK}, X.options());
        for (int64_t n0 = 0; n0 < geo.n; n0 += nb) {
          int64_t count = std::min(nb, geo.n - n0);
          kIm2col<T>.run(X.device(), col.data<T>(), X.data<T>() + n0 * image,
                         chunk_of(geo, count));
          kernels::GemmShape s = detail::gemm_shape(false, true, O, CKK, L);
          s.batch = count;
          s.stride_a = O * L;
          s.stride_b = CKK * L;
          s.stride_c = O * CKK;
          run_gemm<T>(X, s, g.data<T>() + n0 * O * L, col.data<T>(), per_image.data<T>());
          Tensor part = sum(per_image.narrow(0, 0, count), {0});
          gw = gw.defined() ? add(gw, part) : part;
        }
        gw = gw.defined() ? gw.reshape(W.sizes()) : zeros(W.sizes(), W.options());  // no images
      }
      if (next[0].fn) {
        // dcol[n] = Wᵀ [CKK, O] · g[n] [O, L]; dx = col2im(dcol), a chunk at a time.
        Tensor dcol = empty({nb, CKK, L}, X.options());
        gx = empty(X.sizes(), X.options());
        for (int64_t n0 = 0; n0 < geo.n; n0 += nb) {
          int64_t count = std::min(nb, geo.n - n0);
          kernels::GemmShape s = detail::gemm_shape(true, false, CKK, L, O);
          s.batch = count;
          s.stride_a = 0;
          s.stride_b = O * L;
          s.stride_c = CKK * L;
          run_gemm<T>(X, s, W.data<T>(), g.data<T>() + n0 * O * L, dcol.data<T>());
          T* gx_chunk = gx.data<T>() + n0 * image;
          kCol2im<T>.run(X.device(), gx_chunk, dcol.data<T>(), chunk_of(geo, count));
        }
      }
    });
    if (want_b && !direct) gb = sum(g, {0, 2, 3});
    return {gx, gw, gb};
  }
  void release_saved() override {
    x.reset();
    w.reset();
    y.reset();
  }
};

struct MaxPoolBackward final : Node {
  SavedTensor argmax;
  kernels::PoolGeometry geo;
  const char* name() const override { return "MaxPool2dBackward"; }
  std::vector<Tensor> apply(const Tensor& grad) override {
    Tensor g = grad.contiguous(), idx = argmax.get();
    const bool disjoint = g.device().is_cuda() && geo.stride >= geo.k;
    Tensor gx = disjoint ? empty({geo.n, geo.c, geo.h, geo.w}, g.options())
                         : zeros({geo.n, geo.c, geo.h, geo.w}, g.options());
    detail::dispatch_floating(g.dtype(), "max_pool2d backward", [&](auto tag) {
      using T = decltype(tag);
      if (disjoint) {
        LEASEHOLD_CUDA_OR("max_pool2d", kernels::cuda::max_pool_backward_disjoint<T>(
                                            stream_for(g.device()), gx.data<T>(), g.data<T>(),
                                            idx.data<int64_t>(), geo));
      } else {
        kMaxPoolBackward<T>.run(g.device(), gx.data<T>(), g.data<T>(), idx.data<int64_t>(), geo);
      }
    });
    return {gx};
  }
  void release_saved() override { argmax.reset(); }
};

// out = residual + dropout(x) (contiguous, of one shape; without residual
// when it is undefined) with draw's mask. Under autocast one of x and out
// may be bfloat16 and the other float32 (a bfloat16 branch joining the
// residual stream, and its gradient).
void apply_dropout(Tensor& out, const Tensor& x, double p, const RandomDraw& draw,
                   const Tensor& residual = Tensor()) {
  const kernels::RandomKey key{draw.seed, draw.step_data()};
  if (x.dtype() == DType::BFloat16 && out.dtype() == DType::Float32) {
    LEASEHOLD_CUDA_OR("add_dropout", kernels::cuda::dropout_bf16_branch(
                                         stream_for(x.device()), out.data<float>(),
                                         x.data<bfloat16>(), x.numel(), p, key,
                                         residual.defined() ? residual.data<float>() : nullptr));
    return;
  }
  if (x.dtype() == DType::Float32 && out.dtype() == DType::BFloat16) {
    LEASEHOLD_CUDA_OR("add_dropout", kernels::cuda::dropout_bf16_gradient(
                                         stream_for(x.device()), out.data<bfloat16>(),
                                         x.data<float>(), x.numel(), p, key));
    return;
  }
  detail::dispatch_floating(x.dtype(), "dropout", [&](auto tag) {
    using T = decltype(tag);
    kDropout<T>.run(x.device(), out.data<T>(), x.data<T>(), x.numel(), p, key,
                    residual.defined() ? residual.data<T>() : nullptr);
  });
}

// The gradient through the mask forward drew, drawn again from the same
// key (the step counter it mixes in only moves with the optimizer, after
// backward): nothing is saved, and the mask never exists in memory.
// add_dropout's node has the residual first: its gradient is g itself.
struct DropoutBackward final : Node {
  double p = 0;
  RandomDraw draw;
  bool residual = false;  // add_dropout's
  DType x_dtype = DType::Float32;  // x's gradient's (bfloat16: a branch under autocast)
  const char* name() const override {
    return residual ? "AddDropoutBackward" : "DropoutBackward";
  }
  bool saves_tensors() const override { return false; }
  std::vector<Tensor> apply(const Tensor& g) override {
    // (Nothing to draw for an input that needs no gradient: a frozen branch
    // under a trained residual.)
    if (!next[residual ? 1 : 0].fn) {
      if (residual) return {g, Tensor()};
      return {Tensor()};
    }
    const Tensor gc = g.contiguous();
    Tensor gx = empty(gc.sizes(), {x_dtype, gc.device()});
    apply_dropout(gx, gc, p, draw);
    if (residual) return {g, gx};
    return {gx};
  }
};

}  // namespace

void set_conv_workspace_bytes(int64_t bytes) {
  if (bytes <= 0) throw std::invalid_argument("conv workspace must be positive");
  t_column_bytes = bytes;
}
int64_t conv_workspace_bytes() { return t_column_bytes; }

Tensor conv2d(const Tensor& x_in, const Tensor& w_in, const Tensor& bias, int64_t stride,
              int64_t padding, bool then_relu) {
  detail::check_same(x_in, w_in, "conv2d");
  if (x_in.dim() != 4 || w_in.dim() != 4 || x_in.size(1) != w_in.size(1)) {
    throw std::invalid_argument("conv2d: input " + x_in.shape_str() + " and weight " +
                                w_in.shape_str() + " do not fit ([N,C,H,W] and [O,C,KH,KW])");
  }
  if (stride < 1 || padding < 0) {
    throw std::invalid_argument("conv2d: stride must be >= 1 and padding >= 0");
  }
  Tensor x, w;
  {
    NoGradGuard no_grad;
    x = x_in.contiguous();
    w = w_in.contiguous();
  }
  auto geo = geometry(x, w, stride, padding);
  if (geo.h + 2 * padding < geo.kh || geo.w + 2 * padding < geo.kw) {
    throw std::invalid_argument("conv2d: kernel " + w.shape_str() +
                                " larger than the padded "
                                "input " +
                                x.shape_str());
  }
  int64_t O = w.size(0), CKK = geo.c * geo.kh * geo.kw, L = geo.oh() * geo.ow();
  const auto plan = kernels::plan_direct_conv(geo, O, dtype_size(x.dtype()));
  const bool direct = x.device().is_cuda() && plan.fits;
  if (then_relu && !direct) return relu(conv2d(x_in, w_in, bias, stride, padding));
  Tensor out = empty({geo.n, O, geo.oh(), geo.ow()}, x.options());
  Tensor b;
  if (bias.defined()) {
    if (bias.dim() != 1 || bias.size(0) != O) {
      throw std::invalid_argument("conv2d: bias " + bias.shape_str() + " for " + std::to_string(O) +
                                  " output channels");
    }
    detail::check_same(x_in, bias, "conv2d");
    NoGradGuard no_grad;
    b = bias.detach().contiguous();
  }
  detail::dispatch_floating(x.dtype(), "conv2d", [&](auto tag) {
    using T = decltype(tag);
    if (direct) {
      LEASEHOLD_CUDA_OR("conv2d", kernels::cuda::conv2d_direct<T>(
                                      stream_for(x.device()), out.data<T>(), x.data<T>(),
                                      w.data<T>(), b.defined() ? b.data<T>() : nullptr, geo, O,
                                      plan, then_relu));
      return;
    }
    // The bias goes in first and the GEMM adds to it (beta = 1): no second
    // output-sized tensor for a separate add.
    if (b.defined()) {
      NoGradGuard no_grad;
      out.copy_(b.reshape({1, O, 1, 1}).expand(out.sizes()));
    }
    const int64_t image = geo.c * geo.h * geo.w, nb = images_per_chunk(CKK * L * sizeof(T), geo.n);
    Tensor col = empty({nb, CKK, L}, x.options());
    for (int64_t n0 = 0; n0 < geo.n; n0 += nb) {
      int64_t count = std::min(nb, geo.n - n0);
      kIm2col<T>.run(x.device(), col.data<T>(), x.data<T>() + n0 * image, chunk_of(geo, count));
      // out[n] = W [O, CKK] · col[n] [CKK, L]; W is shared by the batch.
      kernels::GemmShape s = detail::gemm_shape(false, false, O, L, CKK);
      s.batch = count;
      s.stride_a = 0;
      s.stride_b = CKK * L;
      s.stride_c = O * L;
      run_gemm<T>(x, s, w.data<T>(), col.data<T>(), out.data<T>() + n0 * O * L,
                  bias.defined() ? T(1) : T(0));
    }
  });
  if (any_requires_grad({&x_in, &w_in, &bias})) {
    auto node = std::make_shared<Conv2dBackward>();
    node->x = SavedTensor(x);
    node->w = SavedTensor(w);
    node->stride = stride;
    node->pad = padding;
    if (then_relu) {
      node->y = SavedTensor(out);
      node->relu = true;
    }
    record(out, node, {&x_in, &w_in, &bias});
  }
  return out;
}

Tensor max_pool2d(const Tensor& x_in, int64_t kernel, int64_t stride) {
  detail::check_defined(x_in, "max_pool2d", "input");
  if (stride == 0) stride = kernel;
  if (x_in.dim() != 4 || kernel < 1 || stride < 1 || x_in.size(2) < kernel ||
      x_in.size(3) < kernel) {
    throw std::invalid_argument("max_pool2d: window " + std::to_string(kernel) + " stride " +
                                std::to_string(stride) + " on input " + x_in.shape_str());
  }
  Tensor x;
  {
    NoGradGuard no_grad;
    x = x_in.contiguous();
  }
  kernels::PoolGeometry geo{x.size(0), x.size(1), x.size(2), x.size(3), kernel, stride};
  Tensor out = empty({geo.n, geo.c, geo.oh(), geo.ow()}, x.options());
  Tensor idx = empty(out.sizes(), {DType::Int64, x.device()});
  detail::dispatch_floating(x.dtype(), "max_pool2d", [&](auto tag) {
    using T = decltype(tag);
    kMaxPool<T>.run(x.device(), out.data<T>(), idx.data<int64_t>(), x.data<T>(), geo);
  });
  if (any_requires_grad({&x_in})) {
    auto node = std::make_shared<MaxPoolBackward>();
    node->argmax = SavedTensor(idx);
    node->geo = geo;
    record(out, node, {&x_in});
  }
  return out;
}

namespace {

// dropout and add_dropout (residual undefined for dropout).
Tensor dropout_op(const Tensor& residual, const Tensor& x, double p, bool training,
                  const char* op) {
  if (p < 0 || p >= 1) {
    throw std::invalid_argument(std::string(op) + ": p = " + std::to_string(p) +
                                " must be in [0, 1)");
  }
  // Under autocast a bfloat16 branch (a product's output kept so) joins a
  // float32 residual stream: the sum is float32, x's gradient bfloat16.
  const bool mixed = residual.defined() && x.defined() && x.dtype() == DType::BFloat16 &&
                     residual.dtype() == DType::Float32 &&
                     autocast_dtype(x.device()) == DType::BFloat16;
  if (x.defined() && x.dtype() == DType::BFloat16 && !mixed) {
    throw std::invalid_argument(std::string(op) +
                                ": a bfloat16 input is taken only as add_dropout's branch onto a "
                                "float32 residual under bfloat16 autocast");
  }
  if (residual.defined()) {
    detail::check_defined(x, op, "input");
    if (!mixed) {
      detail::check_same(residual, x, op);
    } else if (residual.device() != x.device()) {
      throw std::invalid_argument(std::string(op) + ": devices differ (" +
                                  residual.device().str() + " and " + x.device().str() + ")");
    }
    if (residual.sizes() != x.sizes()) {
      throw std::invalid_argument(std::string(op) + ": residual " + residual.shape_str() +
                                  " and input " + x.shape_str() + " differ in shape");
    }
    // (A bfloat16 branch still goes through the kernel, keeping nothing
    // with p 0: the addition alone would need a differentiable conversion.)
    // (Outputs unread: through the dropout's own node below, which with p
    // 0 passes gradients as the addition's does and reads nothing.)
    if ((!training || p == 0) && !mixed && !outputs_unread()) return add(residual, x);
  } else if (!training || p == 0) {
    return x;
  }
  if (!training) p = 0;
  // (p 0 keeps every element without drawing from the step's random numbers.)
  const RandomDraw draw = p > 0 ? RandomDraw::next(x.device()) : RandomDraw{};
  Tensor xc, rc;
  {
    NoGradGuard no_grad;
    xc = x.contiguous();
    if (residual.defined()) rc = residual.contiguous();
  }
  Tensor out = empty(x.sizes(), mixed ? residual.options() : x.options());
  // (Backward draws the mask again and never reads the output.)
  if (!outputs_unread()) apply_dropout(out, xc, p, draw, rc);
  if (any_requires_grad({&residual, &x})) {  // (an undefined residual requires nothing)
    auto node = std::make_shared<DropoutBackward>();
    node->p = p;
    node->draw = draw;
    node->residual = residual.defined();
    node->x_dtype = x.dtype();
    if (residual.defined()) {
      record(out, node, {&residual, &x});
    } else {
      record(out, node, {&x});
    }
  }
  return out;
}

}  // namespace

Tensor dropout(const Tensor& x, double p, bool training) {
  return dropout_op(Tensor(), x, p, training, "dropout");
}

Tensor add_dropout(const Tensor& residual, const Tensor& x, double p, bool training) {
  detail::check_defined(residual, "add_dropout", "residual");
  return dropout_op(residual, x, p, training, "add_dropout");
}

}  // namespace leasehold::engine
