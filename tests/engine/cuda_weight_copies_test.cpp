// Autocast's bfloat16 copies of a step's weights (AutocastWeights) on CUDA:
// the copies' bits, which products read them, release and nesting, and
// a recomputed segment's, made once for its whole backward.
// Skipped without a GPU.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/recompute.h"
#include "kernels/elementwise.h"
#include "shared/device.h"

namespace leasehold::engine::testing {
namespace {

class CudaWeightCopies : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: test skipped";
  }
};

// A step's bfloat16 copies of its weights (AutocastWeights): each the bits
// of its own conversion, across more tensors than one launch takes, lengths
// around the kernel's groups of eight and a tensor that starts off 16-byte
// alignment; products under the scope read the copies (a copy changed on
// purpose changes the product), give the same bits and gradients as
// conversions of their own, and once the scope is gone convert again;
// scopes nest, and each tensor is copied once however often it is named.
TEST_F(CudaWeightCopies, ServeAStepsProducts) {
  manual_seed(43);
  const Device cuda = Device::cuda();
  std::vector<Tensor> params;
  for (int64_t n : {1, 7, 8, 9, 1000, 4099, 384 * 1536}) {
    params.push_back(mul(randn({n}), 100.0).to(cuda).set_requires_grad(true));
  }
  for (int k = 0; k < kernels::kMaxConvertTensors; ++k) params.push_back(randn({k + 3}).to(cuda));
  const Tensor whole = randn({1001}).to(cuda);
  params.push_back(whole.narrow(0, 1, 1000));  // 4 bytes past an aligned start
  params.push_back(params[3]);                 // named twice
  {
    AutocastGuard autocast(DType::BFloat16);
    AutocastWeights copies(params);
    EXPECT_EQ(copies.copies(), params.size() - 1);
    for (size_t k = 0; k < params.size(); ++k) {
      SCOPED_TRACE("tensor " + std::to_string(k));
      const Tensor* copy = copies.find(params[k]);
      ASSERT_NE(copy, nullptr);
      EXPECT_EQ(copy->to(DType::Float32).to_vector<float>(),
                params[k].to(DType::BFloat16).to(DType::Float32).to_vector<float>());
    }
    EXPECT_EQ(copies.find(whole), nullptr) << "another view of the same memory";
    EXPECT_EQ(copies.find(params[5].narrow(0, 0, 8)), nullptr);
  }

  // A layer's products: fp32 and bf16 results, a bias or not, GELU.
  const Tensor x = randn({300, 96}).to(cuda).to(DType::BFloat16);
  const Tensor w = mul(randn({200, 96}), 0.1).to(cuda), b = randn({200}).to(cuda);
  const Tensor g = randn({300, 200}).to(cuda);
  enum Kind { Float32Out, BFloat16Out, Gelu, NoBias };
  for (Kind kind : {Float32Out, BFloat16Out, Gelu, NoBias}) {
    SCOPED_TRACE("kind " + std::to_string(kind));
    std::vector<std::vector<float>> results;
    for (bool scoped : {false, true}) {
      Tensor wi = w.clone().set_requires_grad(true), bi = b.clone().set_requires_grad(true);
      AutocastGuard autocast(DType::BFloat16);
      std::optional<AutocastWeights> copies;
      if (scoped) copies.emplace(std::vector<Tensor>{wi, bi});
      const Tensor bias = kind == NoBias ? Tensor() : bi;
      Tensor y = kind == Gelu ? linear_gelu(x, wi, bias)
                              : linear(x, wi, bias, false,
                                       kind == Float32Out ? ProductOut::Float32
                                                          : ProductOut::LowerPrecision);
      y.backward(g.to(y.dtype()));
      copies.reset();
      results.push_back(y.to(DType::Float32).to_vector<float>());
      results.push_back(wi.grad().to_vector<float>());
      if (kind != NoBias) results.push_back(bi.grad().to_vector<float>());
    }
    const size_t half = results.size() / 2;
    for (size_t i = 0; i < half; ++i) EXPECT_EQ(results[i], results[half + i]) << "result " << i;
  }

  // The copy is what the product reads, and only while the scope lives.
  AutocastGuard autocast(DType::BFloat16);
  NoGradGuard no_grad;
  const Tensor plain = linear(x, w, b, false, ProductOut::Float32);
  {
    AutocastWeights outer(std::vector<Tensor>{b});
    AutocastWeights inner(std::vector<Tensor>{w});
    ASSERT_NE(inner.find(b), nullptr) << "the outer scope's copy";
    {
      // A scope inside copies only what no enclosing scope has a copy of
      // (a segment run again in backward inside one that is).
      AutocastWeights again(std::vector<Tensor>{w, b});
      EXPECT_EQ(again.copies(), 0u);
      EXPECT_EQ(again.find(w), inner.find(w));
      EXPECT_EQ(again.find(b), outer.find(b));
    }
    const Tensor zero16 = zeros({200, 96}, {DType::Float32, cuda}).to(DType::BFloat16);
    const_cast<Tensor*>(inner.find(w))->copy_(zero16);
    const Tensor zeroed = linear(x, w, b, false, ProductOut::LowerPrecision);
    EXPECT_EQ(zeroed.to(DType::Float32).to_vector<float>(),
              b.to(DType::BFloat16).to(DType::Float32).reshape({1, 200}).expand({300, 200})
                  .contiguous().to_vector<float>());
    // The bias's copy too, for a bfloat16 result and through GELU's
    // product: every output is then 0 (gelu(0) = 0).
    const Tensor zero_bias = zeros({200}, {DType::Float32, cuda}).to(DType::BFloat16);
    const_cast<Tensor*>(outer.find(b))->copy_(zero_bias);
    const std::vector<float> all_zero(300 * 200, 0.0f);
    EXPECT_EQ(linear(x, w, b, false, ProductOut::LowerPrecision).to(DType::Float32)
                  .to_vector<float>(),
              all_zero);
    EXPECT_EQ(linear_gelu(x, w, b).to(DType::Float32).to_vector<float>(), all_zero);
  }
  EXPECT_EQ(linear(x, w, b, false, ProductOut::Float32).to_vector<float>(),
            plain.to_vector<float>());
  // Released, the copies are found no more; one a product saved lives on.
  Tensor saved;
  {
    AutocastWeights copies(std::vector<Tensor>{w});
    saved = *copies.find(w);
    copies.release();
    EXPECT_EQ(copies.find(w), nullptr);
    EXPECT_EQ(copies.copies(), 0u);
  }
  EXPECT_EQ(saved.to(DType::Float32).to_vector<float>(),
            w.to(DType::BFloat16).to(DType::Float32).to_vector<float>());
}

// A transformer block that recomputes in backward lets the step's copies of
// its weights go once its forward has read them, from every scope it runs
// in (the step's, here around another); the others keep theirs to the
// scope's release, and so does a block that keeps its activations. Its run
// again in backward converts its own, and the gradients are the bits of a
// block that keeps everything.
TEST_F(CudaWeightCopies, ABlockThatRecomputesLetsItsCopiesGoAfterItsForward) {
  const Device cuda = Device::cuda();
  using Recompute = nn::TransformerBlock::Recompute;
  auto run = [&](Recompute first) {
    SCOPED_TRACE("block a recomputing " + std::to_string(static_cast<int>(first)));
    manual_seed(44);
    nn::TransformerBlock a(64, 4, 0.1, 2), b(64, 4, 0.1, 2);
    a.to(cuda);
    b.to(cuda);
    a.set_recompute(first);
    const Tensor x = randn({2, 24, 64}).to(cuda);
    const Tensor other = randn({8}).to(cuda);
    const Tensor step = zeros({}, {DType::Int64, cuda});
    AutocastGuard autocast(DType::BFloat16);
    std::vector<Tensor> params = a.product_parameters();
    for (Tensor& t : b.product_parameters()) params.push_back(t);
    Tensor out;
    {
      AutocastWeights copies(params);
      {
        AutocastWeights inner(std::vector<Tensor>{other});
        StepRandom random(5, step);
        out = b(a(x));
      }
      for (const Tensor& p : a.product_parameters()) {
        EXPECT_EQ(copies.find(p) != nullptr, first == Recompute::None);
      }
      for (const Tensor& p : b.product_parameters()) EXPECT_NE(copies.find(p), nullptr);
      sum(out).backward();
    }
    std::vector<std::vector<float>> grads;
    for (const Tensor& p : a.parameters()) {
      grads.push_back(p.grad().to(Device::cpu()).to_vector<float>());
    }
    return grads;
  };
  const auto kept = run(Recompute::None);
  EXPECT_EQ(run(Recompute::Block), kept);
  EXPECT_EQ(run(Recompute::Mlp), kept);
  EXPECT_EQ(run(Recompute::BlockButAttention), kept);
}

// A recomputed segment given its weights (recompute.h) copies them in one
// pass as its backward starts, under the autocast mode of its forward
// (backward runs outside it here): its run again reads those copies and
// lets them go, and a segment recorded within it takes its own weights'
// copies from there, which each of its slices reads, making none; the
// gradients are the bits of products that convert their own weights.
TEST_F(CudaWeightCopies, ARecomputedSegmentCopiesItsWeightsOnceForItsWholeBackward) {
  const Device cuda = Device::cuda();
  manual_seed(45);
  const Tensor w1 = randn({16, 16}).to(cuda).set_requires_grad(true);
  const Tensor w2 = randn({16, 16}).to(cuda).set_requires_grad(true);
  const Tensor x = randn({8, 16}).to(cuda).set_requires_grad(true);
  const Tensor step = zeros({}, {DType::Int64, cuda});
  // The copy a run again found for `w` (null: none).
  auto found = [](const Tensor& w) -> const void* {
    const AutocastWeights* copies = autocast_weights();
    const Tensor* copy = copies ? copies->find(w) : nullptr;
    return copy ? copy->raw_data() : nullptr;
  };
  struct Seen {
    std::vector<const void*> outer;   // w1's and w2's copies, as the run again found them
    std::vector<const void*> slices;  // w1's and w2's, as each slice of the inner one did
    uint64_t passes = 0;              // conversion passes in backward
  };
  auto run = [&](bool given, Seen& seen) {
    std::optional<SegmentOutput> inner_out;
    const Segment inner = [&](const Tensor& in, bool replay) {
      if (replay) {
        seen.slices.push_back(found(w1));
        seen.slices.push_back(found(w2));
      }
      return linear(in, w2, Tensor());
    };
    const Segment outer = [&](const Tensor& in, bool replay) {
      const Tensor h = linear(in, w1, Tensor());
      if (!replay) {
        Tensor m = inner(h, false);
        inner_out = SegmentOutput{m.sizes(), m.options()};
        return m;
      }
      seen.outer = {found(w1), found(w2)};
      return record_for_backward(inner, h, *inner_out, 2,
                                 given ? std::vector<Tensor>{w2} : std::vector<Tensor>{});
    };
    for (Tensor t : {w1, w2, x}) t.set_grad(Tensor());
    StepRandom random(5, step);
    Tensor out;
    {
      AutocastGuard autocast(DType::BFloat16);
      out = recompute_in_backward(outer, x, nullptr, 1,
                                  given ? std::vector<Tensor>{w1, w2} : std::vector<Tensor>{});
    }
    const uint64_t before = AutocastWeights::passes_on_this_thread();
    sum(out).backward();
    seen.passes = AutocastWeights::passes_on_this_thread() - before;
    EXPECT_EQ(autocast_weights(), nullptr);
    std::vector<std::vector<float>> grads;
    for (const Tensor& t : {w1, w2, x}) {
      grads.push_back(t.grad().to(Device::cpu()).to_vector<float>());
    }
    return grads;
  };
  Seen own, shared;
  const auto own_grads = run(false, own);
  EXPECT_EQ(own.outer, (std::vector<const void*>{nullptr, nullptr}));
  EXPECT_EQ(own.slices, (std::vector<const void*>(4, nullptr)));
  EXPECT_EQ(own.passes, 0u);
  EXPECT_EQ(run(true, shared), own_grads);
  EXPECT_EQ(shared.passes, 1u);
  ASSERT_EQ(shared.outer.size(), 2u);
  EXPECT_NE(shared.outer[0], nullptr);
  EXPECT_NE(shared.outer[1], nullptr);
  const void* w2_copy = shared.outer[1];
  EXPECT_EQ(shared.slices, (std::vector<const void*>{nullptr, w2_copy, nullptr, w2_copy}))
      << "each slice reads the copy of its own weight taken from the run again, whose other "
         "copies went once it had run";
}

// A transformer block names its weights at each segment it records: one
// conversion pass a recomputed segment that is not within another (the
// attention's and the MLP's in halves: two), whatever its level and its
// MLP's slices, with the gradients of the block that keeps everything.
TEST_F(CudaWeightCopies, ARecomputedBlockCopiesItsWeightsOncePerSegment) {
  const Device cuda = Device::cuda();
  using Recompute = nn::TransformerBlock::Recompute;
  auto run = [&](Recompute level, int64_t parts, uint64_t& passes) {
    manual_seed(46);
    nn::TransformerBlock block(64, 4, 0.1, 2);
    block.to(cuda);
    block.set_recompute(level);
    block.set_mlp_parts(parts);
    const Tensor x = randn({4, 24, 64}).to(cuda);
    const Tensor step = zeros({}, {DType::Int64, cuda});
    StepRandom random(6, step);
    Tensor out;
    {
      AutocastGuard autocast(DType::BFloat16);
      AutocastWeights copies(block.product_parameters());
      out = block(x);
      copies.release();
      const uint64_t before = AutocastWeights::passes_on_this_thread();
      sum(out).backward();
      passes = AutocastWeights::passes_on_this_thread() - before;
    }
    std::vector<std::vector<float>> grads;
    for (const Tensor& p : block.parameters()) {
      grads.push_back(p.grad().to(Device::cpu()).to_vector<float>());
    }
    return grads;
  };
  uint64_t passes = 0;
  const auto kept = run(Recompute::None, 1, passes);
  EXPECT_EQ(passes, 0u);
  const struct {
    Recompute level;
    int64_t parts;
    uint64_t passes;
  } cases[] = {{Recompute::Mlp, 1, 1},   {Recompute::Mlp, 2, 1},
               {Recompute::Halves, 1, 2}, {Recompute::BlockButAttention, 1, 1},
               {Recompute::Block, 1, 1}, {Recompute::Block, 2, 1},
               {Recompute::BlockInHalves, 2, 1}};
  for (const auto& c : cases) {
    SCOPED_TRACE("level " + std::to_string(static_cast<int>(c.level)) + ", MLP in " +
                 std::to_string(c.parts));
    const auto grads = run(c.level, c.parts, passes);
    EXPECT_EQ(passes, c.passes);
    // (Slices sum the weights' gradients in parts: within rounding.)
    if (c.parts == 1) {
      EXPECT_EQ(grads, kept);
    }
  }
}

}  // namespace
}  // namespace leasehold::engine::testing
