#include <gtest/gtest.h>

#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/engine/recompute.h"
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

// Under an OutputsUnreadGuard a product and a dropout's addition record
// their backward but write nothing; the gradients through them are those
// of the same operators run plainly. A ReLU fused into the product reads
// its output in backward: that product is still made.
TEST(Recompute, OutputsUnreadSkipOnlyWhatBackwardDoesNotRead) {
  EXPECT_EQ(outputs_unread_mismatch(Device::cpu()), "");
}

}  // namespace
}  // namespace leasehold::engine
