// Autocast on CUDA: bfloat16 GEMMs and tensor-core attention against the
// float32 CPU kernels, within bfloat16's precision (exactly, where the
// inputs are bfloat16 values), and bfloat16 conversions bit for bit.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "shared/device.h"
#include "tests/engine/counting_allocator.h"
#include "tests/engine/gradcheck.h"
#include "tests/engine/recompute_check.h"

namespace leasehold::engine::testing {
namespace {

class CudaAutocast : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: test skipped";
  }
};

// ‖a − b‖ / ‖b‖ over all elements, `a` on any device, `b` on the CPU: a
// bound for results whose elements round by bfloat16's precision each.
double relative_error(const Tensor& a, const Tensor& b) {
  NoGradGuard no_grad;
  const Tensor bc = b.detach().to(Device::cpu());
  const Tensor d = sub(a.detach().to(Device::cpu()), bc);
  return std::sqrt(sum(mul(d, d)).item() / std::max(sum(mul(bc, bc)).item(), 1e-30));
}

// Autocast: attention's products in bfloat16 on tensor cores, against the
// float32 CPU kernels, on shapes across the kernels' tiles and padded head
// sizes: within bfloat16's precision in norm (1%, gradients 2%) and
// everywhere (an element's error is a fraction of a unit where outputs are
// about 1; a gradient that cancels to about 0 within 1e-2 of it); the
// tensor-core path is taken (its bits differ from the float32 kernels'); and
// its gradients are the same bits every run.
TEST_F(CudaAutocast, AutocastAttentionTracksFloat32OnTensorCores) {
  struct Shape4 {
    Shape shape;
    bool causal;
  };
  const std::vector<Shape4> shapes = {{{2, 3, 256, 64}, true},  {{1, 2, 97, 48}, false},
                                      {{2, 1, 70, 32}, true},   {{1, 2, 200, 128}, true},
                                      {{3, 2, 1, 16}, true},    {{1, 1, 130, 64}, false}};
  for (const auto& [shape, causal] : shapes) {
    SCOPED_TRACE(shape_to_string(shape) + (causal ? " causal" : " full"));
    manual_seed(37);
    std::vector<Tensor> cpu, gpu;
    for (int i = 0; i < 3; ++i) {
      Tensor x = randn(shape);
      cpu.push_back(x.clone().set_requires_grad(true));
      gpu.push_back(x.to(Device::cuda()).set_requires_grad(true));
    }
    Tensor r = randn(shape);
    Tensor ref = scaled_dot_product_attention(cpu[0], cpu[1], cpu[2], causal);
    sum(mul(ref, r)).backward();
    std::vector<std::vector<float>> first;
    for (int run = 0; run < 2; ++run) {
      for (Tensor& x : gpu) x.set_grad(Tensor());
      Tensor got;
      {
        AutocastGuard autocast(DType::BFloat16);
        got = scaled_dot_product_attention(gpu[0], gpu[1], gpu[2], causal);
      }
      sum(mul(got, r.to(Device::cuda()))).backward();
      std::vector<std::vector<float>> grads;
      for (Tensor& x : gpu) grads.push_back(x.grad().to_vector<float>());
      if (run == 1) {
        EXPECT_EQ(grads, first) << "gradients differ between runs";
        continue;
      }
      first = grads;
      NoGradGuard no_grad;
      EXPECT_LE(relative_error(got, ref), 1e-2) << "forward";
      EXPECT_LE(max_rel_diff(got, ref), 4e-2) << "forward";
      if (shape[2] > 1) {
        Tensor plain = scaled_dot_product_attention(gpu[0], gpu[1], gpu[2], causal);
        EXPECT_GT(max_rel_diff(got, plain), 0.0) << "the float32 kernel ran";
      }
      for (int i = 0; i < 3; ++i) {
        SCOPED_TRACE("gradient of input " + std::to_string(i));
        const Tensor& want = cpu[i].grad();
        const double rms = std::sqrt(sum(mul(want, want)).item() / double(want.numel()));
        if (rms > 1e-3) {
          EXPECT_LE(relative_error(gpu[i].grad(), want), 2e-2);
          EXPECT_LE(max_rel_diff(gpu[i].grad(), want), 1e-1);
        } else {
          // A sum that cancels to about 0 (one token: dq = dk = 0): its
          // error is the terms' rounding, not a fraction of the result.
          EXPECT_LE(max_rel_diff(gpu[i].grad(), want), 1e-2);
        }
      }
    }
  }
}

// The same on a fused projection read in place (self_attention, the
// transformer block's path).
TEST_F(CudaAutocast, AutocastSelfAttentionTracksFloat32OnTensorCores) {
  manual_seed(38);
  Tensor x = randn({2, 256, 3 * 3 * 64});
  Tensor xc = x.clone().set_requires_grad(true);
  Tensor xg = x.to(Device::cuda()).set_requires_grad(true);
  Tensor r = randn({2, 256, 3 * 64});
  Tensor ref = self_attention(xc, 3, true);
  sum(mul(ref, r)).backward();
  Tensor got;
  {
    AutocastGuard autocast(DType::BFloat16);
    got = self_attention(xg, 3, true);
  }
  sum(mul(got, r.to(Device::cuda()))).backward();
  EXPECT_LE(relative_error(got, ref), 1e-2);
  EXPECT_LE(relative_error(xg.grad(), xc.grad()), 2e-2);
  EXPECT_LE(max_rel_diff(xg.grad(), xc.grad()), 1e-1);
}

// bfloat16 activations through the attention (the block's path: the
// projection kept in bfloat16): the output is the float32 path's output
// rounded to bfloat16, bit for bit (the kernels read the same bfloat16
// values either way), on a length across tiles and with head sizes the
// kernels pad (40: rows of whole 16-byte words, which the kernels copy
// with cp.async; 36: rows they read an element at a time); the gradient,
// bfloat16 like its tensor, within bfloat16's precision of the float32
// path's.
TEST_F(CudaAutocast, BFloat16ActivationsThroughAttentionMatchTheFloat32Path) {
  for (int64_t d : {64, 40, 36}) {
    SCOPED_TRACE("head size " + std::to_string(d));
    manual_seed(39);
    const int64_t heads = 2, c = heads * d;
    Tensor x = randn({2, 150, 3 * c}).to(DType::BFloat16).to(Device::cuda());
    Tensor w = mul(randn({16, c}), 0.1).to(Device::cuda());
    Tensor x16 = x.clone().set_requires_grad(true);
    Tensor x32 = x.to(DType::Float32).set_requires_grad(true);
    Tensor o16, o32, y16, y32;
    {
      AutocastGuard autocast(DType::BFloat16);
      o16 = self_attention(x16, heads, true);
      o32 = self_attention(x32, heads, true);
      // A product reads the bfloat16 output (as proj does) for backward.
      y16 = linear(o16.reshape({-1, c}), w, Tensor());
      y32 = linear(o32.reshape({-1, c}), w, Tensor());
    }
    ASSERT_EQ(o16.dtype(), DType::BFloat16);
    EXPECT_EQ(relative_error(o16.to(DType::Float32), o32.to(DType::BFloat16).to(DType::Float32)),
              0.0);
    Tensor r = randn({2 * 150, 16}).to(Device::cuda());
    sum(mul(y16, r)).backward();
    sum(mul(y32, r)).backward();
    ASSERT_EQ(x16.grad().dtype(), DType::BFloat16);
    EXPECT_LE(relative_error(x16.grad().to(DType::Float32), x32.grad()), 2e-2);
  }
}

// bfloat16 conversions on the device give the CPU's bits.
TEST_F(CudaAutocast, BFloat16ConversionsMatchTheCpu) {
  manual_seed(34);
  Tensor x = mul(randn({1000, 37}), 100.0);
  auto host = x.to(DType::BFloat16).to(DType::Float32).to_vector<float>();
  auto device = x.to(Device::cuda()).to(DType::BFloat16).to(DType::Float32).to_vector<float>();
  EXPECT_EQ(host, device);
}

// Autocast: a linear layer's GEMMs in bfloat16 on tensor cores. With inputs
// (and the incoming gradient) that bfloat16 holds exactly, the products are
// exact and only the order of float32 sums differs from the CPU: a tight
// bound, and ReLU masks that agree (with rounded inputs a mask could flip
// wherever an output is near 0, changing the gradients there by whole
// values). Then a GPT block on ordinary inputs, within bfloat16's precision.
TEST_F(CudaAutocast, AutocastLinearAndBlockTrackFloat32) {
  for (bool then_relu : {false, true}) {
    for (bool with_bias : {false, true}) {
      SCOPED_TRACE(std::string(then_relu ? "relu" : "no relu") + (with_bias ? ", bias" : ""));
      manual_seed(35);
      auto exact = [](const Tensor& t) { return t.to(DType::BFloat16).to(DType::Float32); };
      Tensor x0 = exact(randn({300, 96})), w0 = exact(mul(randn({200, 96}), 0.1));
      Tensor b0 = randn({200});
      Tensor xc = x0.clone().set_requires_grad(true), wc = w0.clone().set_requires_grad(true);
      Tensor bc = b0.clone().set_requires_grad(true);
      Tensor xg = x0.to(Device::cuda()).set_requires_grad(true);
      Tensor wg = w0.to(Device::cuda()).set_requires_grad(true);
      Tensor bg = b0.to(Device::cuda()).set_requires_grad(true);
      Tensor r = exact(randn({300, 200}));
      Tensor yc = linear(xc, wc, with_bias ? bc : Tensor(), then_relu);
      Tensor yg;
      {
        AutocastGuard autocast(DType::BFloat16);
        yg = linear(xg, wg, with_bias ? bg : Tensor(), then_relu);
      }
      EXPECT_EQ(yg.dtype(), DType::Float32);
      EXPECT_LE(max_rel_diff(yg, yc), 1e-5);
      sum(mul(yc, r)).backward();
      sum(mul(yg, r.to(Device::cuda()))).backward();  // outside the guard: still mixed
      EXPECT_LE(max_rel_diff(xg.grad(), xc.grad()), 1e-5);
      EXPECT_LE(max_rel_diff(wg.grad(), wc.grad()), 1e-5);
      if (with_bias) {
        EXPECT_LE(max_rel_diff(bg.grad(), bc.grad()), 1e-5);
      }
    }
  }

  // The mixed path is taken: a product bfloat16 cannot hold exactly comes
  // out rounded.
  {
    Tensor a = from_vector<float>({1.0f + 0x1p-12f}, {1, 1}).to(Device::cuda());
    Tensor one = ones({1, 1}).to(Device::cuda());
    AutocastGuard autocast(DType::BFloat16);
    EXPECT_EQ(linear(a, one, Tensor()).item(), 1.0);
  }

  // The block's residual branches alone (its output minus its input: the
  // residual would hide them), and its input's gradient, within 2% in norm.
  manual_seed(36);
  nn::TransformerBlock block(64, 4, 0.0, 2);
  Tensor h = randn({2, 40, 64});
  Tensor hc = h.clone().set_requires_grad(true);
  Tensor ref = block.forward(hc);
  Tensor rg = randn({2, 40, 64});
  sum(mul(ref, rg)).backward();
  block.to(Device::cuda());
  Tensor hg = h.to(Device::cuda()).set_requires_grad(true);
  Tensor got;
  {
    AutocastGuard autocast(DType::BFloat16);
    got = block.forward(hg);
  }
  sum(mul(got, rg.to(Device::cuda()))).backward();
  NoGradGuard no_grad;
  EXPECT_LE(relative_error(sub(got, hg), sub(ref, hc)), 2e-2);
  EXPECT_LE(relative_error(sub(hg.grad(), rg.to(Device::cuda())), sub(hc.grad(), rg)), 2e-2);
  EXPECT_THROW(AutocastGuard(DType::Float64), std::invalid_argument);
}

// Under bfloat16 autocast on a GPU too, blocks whose MLP, or all of which,
// runs again in backward give the loss and every gradient of blocks that
// keep their activations, bit for bit (recompute_test.cpp holds the CPU to
// the same), and keep less.
TEST_F(CudaAutocast, RecomputedBlocksGiveTheSameGradients) {
  EXPECT_EQ(recompute_mismatch(Device::cuda(), true), "");
}

// And with their MLPs run again in slices of the batch (the GPU's products
// of fewer rows, rounded to bfloat16): within rounding, each gradient
// ready once, less at once in backward.
TEST_F(CudaAutocast, MlpsRunAgainInSlicesNeedLessInBackward) {
  EXPECT_EQ(sliced_mlp_mismatch(Device::cuda(), true), "");
}

// Outputs made under an OutputsUnreadGuard on a GPU (where a product's
// ReLU is fused, and its output is its backward's mask): the gradients of
// the same operators run plainly.
TEST_F(CudaAutocast, UnreadOutputsGiveTheSameGradients) {
  EXPECT_EQ(outputs_unread_mismatch(Device::cuda()), "");
}

// A linear layer's bias gradient under autocast is summed on the device in
// float32 in a fixed order, over parts of rows and then the parts: with
// more parts than a block's lanes of them (20,000 rows), widths read 8
// columns a load (40, the second load of a block's threads past the end)
// and one at a time (13), it is the float32 sum of the gradient's rows
// (bfloat16 values: its copy for the products loses nothing), the same
// bits every run.
TEST_F(CudaAutocast, BiasGradientsSumEveryRowInAFixedOrder) {
  for (int64_t cols : {40, 13}) {
    SCOPED_TRACE("width " + std::to_string(cols));
    manual_seed(43);
    const int64_t rows = 20000;
    const Tensor x = randn({rows, 16}).to(Device::cuda());
    const Tensor w = randn({cols, 16}).to(Device::cuda());
    const Tensor g = randn({rows, cols}).to(DType::BFloat16).to(DType::Float32);
    const std::vector<double> want = sum(g.to(DType::Float64), {0}).to_vector<double>();
    std::vector<float> first;
    for (int run = 0; run < 2; ++run) {
      Tensor b = zeros({cols}).to(Device::cuda()).set_requires_grad(true);
      {
        AutocastGuard autocast(DType::BFloat16);
        linear(x, w, b).backward(g.to(Device::cuda()));
      }
      const std::vector<float> got = b.grad().to_vector<float>();
      ASSERT_EQ(got.size(), want.size());
      for (size_t c = 0; c < got.size(); ++c) EXPECT_NEAR(got[c], want[c], 1e-3) << "column " << c;
      if (run == 0) {
        first = got;
      } else {
        EXPECT_EQ(got, first);
      }
    }
  }
}

// A bfloat16 branch (a product's output kept so) joining the float32
// residual stream under autocast: add_dropout's sum is the float32
// operation's on x's values, bit for bit, and x's gradient that one's
// rounded to bfloat16; over 16-byte words and a tail, a residual one
// element off its words, training (p 0.3) or not (nothing drawn). Without
// autocast the two types are an error.
TEST_F(CudaAutocast, AddDropoutJoinsABFloat16BranchToTheResidualStream) {
  for (int64_t n : {4096, 1027}) {
    for (bool shifted : {false, true}) {
      for (bool training : {true, false}) {
        SCOPED_TRACE(std::to_string(n) + (shifted ? ", residual one element in" : "") +
                     (training ? ", training" : ", not training"));
        manual_seed(44);
        const Tensor base = randn({n + 1}).to(Device::cuda());
        const Tensor residual = base.narrow(0, shifted ? 1 : 0, n);
        const Tensor x16 = randn({n}).to(Device::cuda()).to(DType::BFloat16);
        const Tensor g = randn({n}).to(Device::cuda());
        auto leaf = [](const Tensor& t) { return t.detach().set_requires_grad(true); };
        Tensor r1 = leaf(residual), x1 = leaf(x16), out16;
        {
          AutocastGuard autocast(DType::BFloat16);
          manual_seed(77);
          out16 = add_dropout(r1, x1, 0.3, training);
        }
        out16.backward(g);
        Tensor r2 = leaf(residual), x2 = leaf(x16.to(DType::Float32));
        manual_seed(77);
        Tensor out32 = add_dropout(r2, x2, 0.3, training);
        out32.backward(g);
        ASSERT_EQ(out16.dtype(), DType::Float32);
        EXPECT_EQ(out16.to_vector<float>(), out32.to_vector<float>());
        ASSERT_EQ(x1.grad().dtype(), DType::BFloat16);
        EXPECT_EQ(x1.grad().to(DType::Float32).to_vector<float>(),
                  x2.grad().to(DType::BFloat16).to(DType::Float32).to_vector<float>());
        EXPECT_EQ(r1.grad().to_vector<float>(), r2.grad().to_vector<float>());
      }
    }
  }
  const Tensor residual = ones({8}).to(Device::cuda());
  const Tensor x16 = ones({8}).to(Device::cuda()).to(DType::BFloat16);
  EXPECT_THROW(add_dropout(residual, x16, 0.1, true), std::invalid_argument);
}

// A layer norm asked for a bfloat16 output under autocast writes its
// float32 output rounded, bit for bit; given a bfloat16 gradient it
// returns the bits the float32 path returns for the same values. Widths
// through the register kernels (384; 8, with most lanes idle) and the
// scalar ones (30, not a multiple of 4; 1100, over the registers' 1024).
TEST_F(CudaAutocast, LayerNormWritesBFloat16ForProducts) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {300, 384}, {67, 8}, {37, 30}, {5, 1100}};
  for (auto [rows, cols] : shapes) {
    SCOPED_TRACE(std::to_string(rows) + " x " + std::to_string(cols));
    manual_seed(41);
    const Tensor x = randn({rows, cols}).to(Device::cuda());
    const Tensor w = randn({cols}).to(Device::cuda()), b = randn({cols}).to(Device::cuda());
    const Tensor g16 = randn({rows, cols}).to(Device::cuda()).to(DType::BFloat16);
    std::vector<std::vector<Tensor>> grads;
    Tensor y16, y32;
    for (bool lower : {true, false}) {
      Tensor xi = x.clone().set_requires_grad(true), wi = w.clone().set_requires_grad(true),
             bi = b.clone().set_requires_grad(true);
      AutocastGuard autocast(DType::BFloat16);
      if (lower) {
        y16 = layer_norm(xi, wi, bi, 1e-5, ProductOut::LowerPrecision);
        y16.backward(g16);
      } else {
        y32 = layer_norm(xi, wi, bi);
        y32.backward(g16.to(DType::Float32));
      }
      grads.push_back({xi.grad(), wi.grad(), bi.grad()});
    }
    ASSERT_EQ(y16.dtype(), DType::BFloat16);
    ASSERT_EQ(y32.dtype(), DType::Float32);
    EXPECT_EQ(y16.to(DType::Float32).to_vector<float>(),
              y32.to(DType::BFloat16).to(DType::Float32).to_vector<float>());
    for (size_t i = 0; i < 3; ++i) {
      SCOPED_TRACE("gradient " + std::to_string(i));
      EXPECT_EQ(grads[0][i].dtype(), DType::Float32);
      EXPECT_EQ(grads[0][i].to_vector<float>(), grads[1][i].to_vector<float>());
    }
  }
}

// A GPT's final norm before its output head, in a Sequential under
// autocast: the norm writes bfloat16 for the head (the bits the head's own
// conversion of a float32 output would give, so the same logits), and the
// forward never holds the float32 output (rows x width x 4 bytes fewer at
// its peak). The gradients are the float32 path's within bfloat16's
// precision: the norm's output gradient comes back rounded, as in
// PyTorch, where autocast casts before the product.
TEST_F(CudaAutocast, AFinalNormFeedsTheOutputHeadInBFloat16) {
  const int64_t rows = 512, dim = 64, vocab = 96;
  manual_seed(43);
  auto embedding = std::make_shared<nn::Embedding>(vocab, dim);
  auto norm = std::make_shared<nn::LayerNorm>(dim);
  auto head = std::make_shared<nn::TiedOutput>(embedding);
  nn::Sequential model({norm, head});
  embedding->to(Device::cuda());
  norm->to(Device::cuda());
  const Tensor x = randn({rows, dim}).to(Device::cuda());
  const Tensor r = randn({rows, vocab}).to(Device::cuda());
  std::vector<Tensor> params = norm->parameters();  // (the head's table is the embedding's)
  params.push_back(embedding->weight());
  auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cuda()));
  AllocatorGuard counted(counting);
  struct Run {
    Tensor logits;
    uint64_t peak;
    std::vector<Tensor> grads;
  };
  auto run = [&](bool sequential) {
    Run out;
    for (Tensor p : params) p.set_grad(Tensor());
    Tensor xi = x.clone().set_requires_grad(true);
    counting->restart_peak();
    const uint64_t before = counting->stats().in_use_bytes;
    {
      AutocastGuard autocast(DType::BFloat16);
      out.logits = sequential ? model(xi) : head->forward(norm->forward(xi));
    }
    out.peak = counting->stats().peak_in_use_bytes - before;
    sum(mul(out.logits, r)).backward();
    out.grads = {xi.grad()};
    for (const Tensor& p : params) out.grads.push_back(p.grad().clone());
    return out;
  };
  const Run fused = run(true), plain = run(false);
  EXPECT_EQ(fused.logits.dtype(), DType::Float32);
  EXPECT_EQ(fused.logits.to_vector<float>(), plain.logits.to_vector<float>());
  EXPECT_LE(fused.peak + static_cast<uint64_t>(rows * dim * 4), plain.peak)
      << "the float32 output is never made";
  ASSERT_EQ(fused.grads.size(), plain.grads.size());
  for (size_t i = 0; i < fused.grads.size(); ++i) {
    SCOPED_TRACE("gradient " + std::to_string(i));
    EXPECT_EQ(fused.grads[i].dtype(), DType::Float32);
    EXPECT_LE(relative_error(fused.grads[i], plain.grads[i]), 1e-2);
  }
}

// A product whose result feeds the next product keeps it in bfloat16 (the
// MLP: fc1 with GELU as its epilogue, or a plain lower-precision output),
// and the next product reads it as it is: values and gradients within
// bfloat16's precision of float32 on the CPU, the activation bfloat16, the
// parameters' gradients float32. The widths cover
// cuBLASLt's fused epilogues (multiples of 8) and the separate passes it
// leaves to the engine (a width of 7).
TEST_F(CudaAutocast, ProductsFeedingProductsKeepBFloat16Between) {
  for (int64_t hidden : {64, 7}) {
    for (bool gelu_epilogue : {true, false}) {
      SCOPED_TRACE("hidden " + std::to_string(hidden) + (gelu_epilogue ? ", gelu" : ", plain"));
      manual_seed(37);
      Tensor x = randn({130, 48}), w1 = mul(randn({hidden, 48}), 0.2), b1 = randn({hidden});
      Tensor w2 = mul(randn({24, hidden}), 0.2), b2 = randn({24}), r = randn({130, 24});
      std::vector<Tensor> cpu{x, w1, b1, w2, b2}, gpu;
      for (Tensor& t : cpu) {
        gpu.push_back(t.to(Device::cuda()).set_requires_grad(true));
        t.set_requires_grad(true);
      }
      auto first = [&](const std::vector<Tensor>& p) {
        return gelu_epilogue ? linear_gelu(p[0], p[1], p[2])
                             : linear(p[0], p[1], p[2], false, ProductOut::LowerPrecision);
      };
      Tensor ref = linear(first(cpu), cpu[3], cpu[4]);
      sum(mul(ref, r)).backward();
      Tensor mid, got;
      {
        AutocastGuard autocast(DType::BFloat16);
        mid = first(gpu);
        got = linear(mid, gpu[3], gpu[4]);
      }
      EXPECT_EQ(mid.dtype(), DType::BFloat16);
      EXPECT_EQ(got.dtype(), DType::Float32);
      sum(mul(got, r.to(Device::cuda()))).backward();
      EXPECT_LE(relative_error(got, ref), 2e-2);
      for (size_t i = 0; i < cpu.size(); ++i) {
        SCOPED_TRACE("gradient " + std::to_string(i));
        EXPECT_EQ(gpu[i].grad().dtype(), DType::Float32);
        EXPECT_LE(relative_error(gpu[i].grad(), cpu[i].grad()), 3e-2);
      }
    }
  }
  // A bfloat16 result read by two products: its two gradients summed (in
  // float32) before they reach the product that made it.
  {
    manual_seed(40);
    Tensor x = randn({64, 32}), w1 = mul(randn({48, 32}), 0.2), b1 = randn({48});
    Tensor wa = mul(randn({8, 48}), 0.2), wb = mul(randn({8, 48}), 0.2);
    std::vector<Tensor> cpu{x, w1, b1, wa, wb}, gpu;
    for (Tensor& t : cpu) {
      gpu.push_back(t.to(Device::cuda()).set_requires_grad(true));
      t.set_requires_grad(true);
    }
    auto twice = [](const std::vector<Tensor>& p, ProductOut out) {
      Tensor mid = linear(p[0], p[1], p[2], false, out);
      return add(linear(mid, p[3], Tensor()), linear(mid, p[4], Tensor()));
    };
    sum(twice(cpu, ProductOut::Float32)).backward();
    {
      AutocastGuard autocast(DType::BFloat16);
      Tensor y = twice(gpu, ProductOut::LowerPrecision);
      sum(y).backward();
    }
    for (size_t i = 0; i < cpu.size(); ++i) {
      SCOPED_TRACE("read twice, gradient " + std::to_string(i));
      EXPECT_LE(relative_error(gpu[i].grad(), cpu[i].grad()), 3e-2);
    }
  }
  // Without autocast a bfloat16 input is an error that names the types.
  Tensor x16 = ones({2, 3}).to(Device::cuda()).to(DType::BFloat16);
  Tensor w = ones({4, 3}).to(Device::cuda());
  EXPECT_THROW(linear(x16, w, Tensor()), std::invalid_argument);
}

}  // namespace
}  // namespace leasehold::engine::testing
