#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/recompute.h"
#include "tests/engine/counting_allocator.h"
#include "tests/engine/recompute_check.h"

namespace leasehold::engine {
namespace {

// Blocks whose MLP, or all of which, runs again in backward give the loss
// and every gradient of blocks that keep their activations, bit for bit,
// with dropout on (its masks drawn again at their place in the step), and
// keep less memory between forward and backward: whole blocks less than
// half.
TEST(Recompute, BlocksRunAgainGiveTheSameGradientsAndKeepLess) {
  EXPECT_EQ(recompute_mismatch(Device::cpu(), false), "");
}

// The MLPs run again in slices of the batch, in every mode: the same loss,
// gradients within rounding, each ready once, less at once in backward.
TEST(Recompute, MlpsRunAgainInSlicesNeedLessInBackward) {
  EXPECT_EQ(sliced_mlp_mismatch(Device::cpu(), false), "");
}

// The gradient a recomputed segment's output receives is let go once the
// segment's own backward has read it (its first node has run), not when
// the segment's whole backward returns: a GPT block's would stay through
// the block's attention backward, where a budgeted step has its peak. The
// gradients are the same.
TEST(Recompute, ASegmentsOutputGradientGoesOnceItsBackwardHasReadIt) {
  auto run = [](bool recompute) {
    const size_t output_gradient_bytes = 600 * sizeof(float);  // (no other tensor's size)
    auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
    int freed = 0;
    counting->on_free = [&](void*, size_t bytes) { freed += bytes == output_gradient_bytes; };
    AllocatorGuard counted(counting);
    manual_seed(11);
    Tensor wa = rand({1000}).set_requires_grad(true), c = rand({600});
    Tensor x = rand({1000}).set_requires_grad(true);
    Segment f = [&](const Tensor& in, bool) { return tanh(mul(in, wa)).narrow(0, 0, 600); };
    Tensor step = zeros({}, {DType::Int64, Device::cpu()});
    StepRandom random(3, step);
    Tensor out = recompute ? recompute_in_backward(f, x) : f(x, false);
    Tensor loss = sum(mul(out, c));  // (out's gradient: 600 floats, made by the product's)
    out = Tensor();
    std::vector<int> freed_at_wa;  // when wa's gradient is ready: the segment's last node
    GradientReadyGuard ready([&](const Tensor& leaf) {
      if (leaf.impl() == wa.impl()) freed_at_wa.push_back(freed);
    });
    freed = 0;
    loss.backward();
    return std::make_tuple(freed_at_wa, wa.grad().to_vector<float>(), x.grad().to_vector<float>());
  };
  // (Two of its size by then: the sum's gradient, and the output's.)
  const auto [kept_freed_at_wa, kept_wa_grad, kept_x_grad] = run(false);
  ASSERT_EQ(kept_freed_at_wa, std::vector<int>{2});
  const auto [freed_at_wa, wa_grad, x_grad] = run(true);
  EXPECT_EQ(freed_at_wa, std::vector<int>{2})
      << "the output's gradient still held when the segment's backward reached its input";
  EXPECT_EQ(wa_grad, kept_wa_grad);
  EXPECT_EQ(x_grad, kept_x_grad);
}

// A segment run again in slices whose input's gradient so far (from its
// other consumers) nothing else reads gathers its own input's gradient
// into that sum's memory: it allocates nothing of its input's size (its
// slices are half that). Where the sum is also the segment's own output
// gradient (read slice by slice), it makes its own. The input's gradient
// is the same as the segment run whole gives, bit for bit.
TEST(Recompute, InSlicesTheInputsGradientIsGatheredIntoItsSumSoFarWhereNothingElseReadsIt) {
  auto run = [](int64_t parts, bool sum_owned) {
    const size_t input_bytes = 10 * 100 * sizeof(float);
    auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
    int allocated = 0;  // of the input's size, by the segment's own node
    counting->on_allocate = [&](size_t bytes) {
      allocated += bytes == input_bytes &&
                   std::string_view(backward_node_running()) == "RecomputeBackward";
    };
    AllocatorGuard counted(counting);
    manual_seed(13);
    Tensor w = rand({100}).set_requires_grad(true), c = rand({10, 100});
    Tensor x0 = rand({10, 100}).set_requires_grad(true);
    Segment f = [&](const Tensor& in, bool) { return tanh(mul(in, w)); };
    Tensor step = zeros({}, {DType::Int64, Device::cpu()});
    StepRandom random(3, step);
    Tensor h = mul(x0, 2.0);
    Tensor s = recompute_in_backward(f, h, nullptr, parts);
    // (Through a product, the segment's output gradient is a tensor of its
    // own; added straight, it is the residual's gradient itself.)
    Tensor loss = sum(add(h, sum_owned ? mul(s, c) : s));
    h = Tensor();
    s = Tensor();
    loss.backward();
    return std::make_pair(allocated, x0.grad().to_vector<float>());
  };
  for (bool owned : {true, false}) {
    SCOPED_TRACE(owned);
    const auto [sliced_allocated, sliced_x0] = run(2, owned);
    EXPECT_EQ(sliced_x0, run(1, owned).second);
    EXPECT_EQ(sliced_allocated, owned ? 0 : 1)
        << (owned ? "the input's gradient not gathered into the sum so far"
                  : "gathered into the sum so far, which the slices read");
  }
}

// Where that sum so far is the segment's alone, the segment's first
// operator on its input that takes it (a layer norm, as a GPT MLP's)
// writes the input's gradient over it itself, whole or slice by slice:
// no gradient of the slice's size is made and copied there after, by the
// norm or by the input's accumulator. Where something else reads the
// sum, the norm makes its own, one a slice. The input's gradient is the
// same bits either way, and as the segment run without recompute gives.
TEST(Recompute, ALayerNormWritesItsInputsGradientOverTheSegmentsOwnSumSoFar) {
  auto run = [](int64_t parts, bool sum_owned) {
    const size_t slice_bytes = 10 * 100 * sizeof(float) / std::max<int64_t>(parts, 1);
    auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
    int made = 0;  // of a slice's size, by the layer norm's backward or an accumulator
    counting->on_allocate = [&](size_t bytes) {
      const std::string_view node = backward_node_running();
      made += bytes == slice_bytes && (node == "LayerNormBackward" || node == "AccumulateGrad");
    };
    AllocatorGuard counted(counting);
    manual_seed(17);
    Tensor w = rand({100}).set_requires_grad(true), b = rand({100}).set_requires_grad(true);
    Tensor v = rand({100}).set_requires_grad(true), c = rand({10, 100});
    Tensor x0 = rand({10, 100}).set_requires_grad(true);
    Segment f = [&](const Tensor& in, bool) { return tanh(mul(layer_norm(in, w, b), v)); };
    Tensor step = zeros({}, {DType::Int64, Device::cpu()});
    StepRandom random(3, step);
    Tensor h = mul(x0, 2.0);
    // (parts 0: the segment as it is, keeping its activations.)
    Tensor s = parts > 0 ? recompute_in_backward(f, h, nullptr, parts) : f(h, false);
    Tensor loss = sum(add(h, sum_owned ? mul(s, c) : s));
    h = Tensor();
    s = Tensor();
    loss.backward();
    return std::make_pair(made, x0.grad().to_vector<float>());
  };
  for (bool owned : {true, false}) {
    const std::vector<float> kept = run(0, owned).second;
    for (int64_t parts : {1, 2}) {
      SCOPED_TRACE(std::to_string(parts) + (owned ? " owned" : " shared"));
      const auto [made, x0_grad] = run(parts, owned);
      EXPECT_EQ(made, owned ? 0 : parts)
          << (owned ? "the gradient made apart, not written over the sum so far"
                    : "written over a sum so far that the segment's slices read");
      EXPECT_EQ(x0_grad, kept);
    }
  }
}

// Outside a StepRandom the masks could not be drawn again: the segment
// runs as it is, recording its own graph.
TEST(Recompute, OutsideAStepRandomTheSegmentRunsAsItIs) {
  Tensor w = ones({3}).set_requires_grad(true);
  Tensor x = from_vector<float>({1, 2, 3}, {3}).set_requires_grad(true);
  int runs = 0;
  std::vector<bool> replays;  // per run: whether it ran again in backward
  Segment f = [&](const Tensor& in, bool replay) {
    ++runs;
    replays.push_back(replay);
    return mul(in, w);
  };
  Tensor out = recompute_in_backward(f, x);
  ASSERT_TRUE(out.grad_fn());
  EXPECT_STRNE(out.grad_fn()->name(), "RecomputeBackward");
  sum(out).backward();
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{1, 2, 3}));

  // Inside one it runs again in backward, once; without grad mode not at all.
  Tensor step = zeros({}, {DType::Int64, Device::cpu()});
  StepRandom random(3, step);
  w.set_grad(Tensor());
  out = recompute_in_backward(f, x);
  EXPECT_STREQ(out.grad_fn()->name(), "RecomputeBackward");
  sum(out).backward();
  EXPECT_EQ(runs, 3);
  EXPECT_EQ(replays, (std::vector<bool>{false, false, true}));
  EXPECT_EQ(w.grad().to_vector<float>(), (std::vector<float>{1, 2, 3}));
  EXPECT_EQ(x.grad().to_vector<float>(), (std::vector<float>{2, 2, 2}));
  {
    NoGradGuard no_grad;
    EXPECT_FALSE(recompute_in_backward(f, x).grad_fn());
  }
  EXPECT_EQ(runs, 4);
  EXPECT_FALSE(replays.back());
}

// y = x, whose backward takes x's gradient so far where it is offered one
// (Node::fold_into_input0), as a layer norm does, and counts the offers.
struct FoldingIdentity final : Node {
  int* folds = nullptr;
  Tensor plus;
  const char* name() const override { return "FoldingIdentity"; }
  bool saves_tensors() const override { return false; }
  bool fold_into_input0(const Tensor& sum_so_far) override {
    plus = sum_so_far;
    ++*folds;
    return true;
  }
  std::vector<Tensor> apply(const Tensor& g) override {
    const Tensor p = std::move(plus);
    return {p.defined() ? add(p, g) : g};
  }
};

Tensor folding_identity(const Tensor& x, int* folds) {
  Tensor out;
  {
    NoGradGuard no_grad;
    out = x.clone();
  }
  auto node = std::make_shared<FoldingIdentity>();
  node->folds = folds;
  record(out, node, {&x});
  return out;
}

// A segment's input that also feeds another operator (a transformer
// block's MLP and its residual addition): the other's part of its
// gradient goes into the run again's backward, to the segment's first
// operator on it, which adds it as it writes its own (where the engine
// would add the two after, one more pass); the gradients are the same.
// Run in slices, each slice's backward takes its own rows of the other
// part (slices of 1 and 2 rows, never more slices than rows). A segment
// whose output does not depend on its input gives it the other part alone,
// whole or in slices.
TEST(Recompute, TheInputsOtherGradientIsAddedWithinTheSegment) {
  Tensor step = zeros({}, {DType::Int64, Device::cpu()});
  const std::vector<float> w_values{1, 2, 3};
  for (const auto& [rows, parts, slices] :
       std::vector<std::tuple<int64_t, int64_t, int>>{{2, 1, 1}, {2, 2, 2}, {3, 2, 2}, {3, 4, 3}}) {
    SCOPED_TRACE(std::to_string(rows) + " rows in " + std::to_string(parts) + " parts");
    Tensor w = from_vector<float>(w_values, {1, 3}).set_requires_grad(true);
    std::vector<float> xs, cs;
    for (int64_t i = 0; i < rows * 3; ++i) {
      xs.push_back(static_cast<float>(i + 1));
      cs.push_back(static_cast<float>(2 * i + 3));  // a different gradient for every element
    }
    Tensor x = from_vector<float>(xs, {rows, 3}).set_requires_grad(true);
    const Tensor c = from_vector<float>(cs, {rows, 3});
    int folds = 0;
    Segment f = [&](const Tensor& in, bool) { return mul(folding_identity(in, &folds), w); };
    Tensor out;
    {
      StepRandom random(3, step);
      out = add(x, recompute_in_backward(f, x, nullptr, parts));
    }
    sum(mul(out, c)).backward();
    EXPECT_EQ(folds, slices);
    std::vector<float> want_x, want_w(3, 0.0f);
    for (int64_t i = 0; i < rows * 3; ++i) {
      want_x.push_back(cs[i] * (1 + w_values[i % 3]));
      want_w[i % 3] += cs[i] * xs[i];
    }
    EXPECT_EQ(x.grad().to_vector<float>(), want_x);
    EXPECT_EQ(w.grad().to_vector<float>(), want_w);

    Tensor v = from_vector<float>({5, 6, 7}, {1, 3}).set_requires_grad(true);
    Segment constant = [&](const Tensor& in, bool) {
      return mul(v, ones(in.sizes()));  // (in's rows, none of its values)
    };
    x.set_grad(Tensor());
    {
      StepRandom random(3, step);
      out = add(x, recompute_in_backward(constant, x, nullptr, parts));
    }
    sum(mul(out, c)).backward();
    EXPECT_EQ(x.grad().to_vector<float>(), cs);
  }
}

// In parts, backward runs the segment again over slices of x's rows, each
// at most one row apart in size, never more slices than rows: 5 rows in 2
// slices of 2 and 3, 3 rows in 4 parts as 3 slices of one. The input's
// gradient is gathered from the slices and the parameter's summed over
// them: with these integers, the whole batch's exactly. A parameter's
// gradient-ready hook hears of it once.
TEST(Recompute, InPartsBackwardRunsTheSegmentOverSlicesOfRows) {
  for (const auto& [rows, parts, slices] :
       std::vector<std::tuple<int64_t, int64_t, std::vector<int64_t>>>{
           {5, 2, {2, 3}}, {3, 4, {1, 1, 1}}, {4, 1, {4}}}) {
    SCOPED_TRACE(std::to_string(rows) + " rows in " + std::to_string(parts) + " parts");
    Tensor w = from_vector<float>({1, -2}, {2}).set_requires_grad(true);
    std::vector<float> values;
    for (int64_t i = 0; i < rows * 2; ++i) values.push_back(static_cast<float>(i + 1));
    Tensor x = from_vector<float>(values, {rows, 2}).set_requires_grad(true);
    std::vector<int64_t> seen;  // the rows of each run again
    Segment f = [&](const Tensor& in, bool replay) {
      if (replay) seen.push_back(in.size(0));
      return mul(mul(in, in), w);  // x² w, row by row
    };
    Tensor step = zeros({}, {DType::Int64, Device::cpu()});
    Tensor out;
    {
      StepRandom random(3, step);
      out = recompute_in_backward(f, x, nullptr, parts);
    }
    int ready = 0;
    {
      GradientReadyGuard hook([&](const Tensor& leaf) {
        if (leaf.impl() == w.impl()) ++ready;
      });
      sum(out).backward();
    }
    EXPECT_EQ(seen, slices);
    EXPECT_EQ(ready, 1);
    std::vector<float> want_x, want_w{0, 0};
    for (int64_t i = 0; i < rows * 2; ++i) {
      want_x.push_back(2 * values[i] * (i % 2 == 0 ? 1.0f : -2.0f));
      want_w[i % 2] += values[i] * values[i];
    }
    EXPECT_EQ(x.grad().to_vector<float>(), want_x);
    EXPECT_EQ(w.grad().to_vector<float>(), want_w);
  }
}

// Under an OutputsUnreadGuard a product and a dropout's addition record
// their backward but write nothing; the gradients through them are those
// of the same operators run plainly. A ReLU fused into the product reads
// its output in backward: that product is still made.
TEST(Recompute, OutputsUnreadSkipOnlyWhatBackwardDoesNotRead) {
  EXPECT_EQ(outputs_unread_mismatch(Device::cpu()), "");
}

}  // namespace
}  // namespace leasehold::engine
