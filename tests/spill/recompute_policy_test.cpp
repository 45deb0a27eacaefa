// RecomputePolicy's steps on its own, without memory behind them: what it
// recomputes after each kind of failure, its last step, and run_step's
// retries (spill_training_test.cpp trains through the same policy within
// a budget).
#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/autograd.h"
#include "agent/engine/nn.h"
#include "agent/engine/ops.h"
#include "agent/recompute_policy.h"

namespace leasehold::testing {
namespace {

namespace E = engine;

// Appends `n` small transformer blocks to `net`.
void add_blocks(E::nn::Sequential& net, int n) {
  for (int i = 0; i < n; ++i) {
    net.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, n));
  }
}

// The policy's steps: none without a failure; for a graph that did not fit
// one each, MLP, whole block but its attention, whole block, then the MLP
// in slices of the batch, even with nothing that spills; none after.
TEST(RecomputePolicySteps, AGraphThatDidNotFitTakesOneStepEachUntilNoneIsLeft) {
  E::nn::Sequential net;
  net.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 1));
  RecomputePolicy policy(net, nullptr);
  using Step = RecomputePolicy::Step;
  EXPECT_EQ(policy.after_step(false), Step::None);
  EXPECT_EQ(policy.mlps() + policy.whole(), 0);
  EXPECT_EQ(policy.after_step(true), Step::GraphDidNotFit);
  EXPECT_EQ(policy.mlps(), 1);
  EXPECT_EQ(policy.after_step(true), Step::GraphDidNotFit);
  EXPECT_EQ(policy.mlps(), 0);
  EXPECT_EQ(policy.but_attention(), 1);
  EXPECT_EQ(policy.after_step(true), Step::GraphDidNotFit);
  EXPECT_EQ(policy.but_attention(), 0);
  EXPECT_EQ(policy.whole(), 1);
  EXPECT_FALSE(policy.mlps_sliced());
  EXPECT_EQ(policy.after_step(true), Step::GraphDidNotFit);
  EXPECT_TRUE(policy.mlps_sliced());
  EXPECT_EQ(policy.whole(), 1);
  EXPECT_EQ(policy.after_step(true), Step::None) << "nothing is left to recompute";
}

// Each level goes through every block but the last, from the first,
// before the next level starts: every MLP, then every block but its
// attention, then whole blocks; then the last block through the same
// levels (its backward comes first: what it recomputes is all made again
// at once there); then the blocks' MLPs in slices of the batch, one block
// at each step, from the last. The log names each count.
TEST(RecomputePolicySteps, EachLevelGoesThroughEveryBlockBeforeTheNext) {
  E::nn::Sequential net;
  std::vector<std::shared_ptr<E::nn::TransformerBlock>> blocks;
  for (int i = 0; i < 2; ++i) {
    blocks.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 2));
    net.push_back(blocks.back());
  }
  RecomputePolicy policy(net, nullptr);
  using R = E::nn::TransformerBlock::Recompute;
  const std::vector<std::pair<R, R>> expected = {
      {R::Mlp, R::None},
      {R::BlockButAttention, R::None},
      {R::Block, R::None},
      {R::Block, R::Mlp},
      {R::Block, R::BlockButAttention},
      {R::Block, R::Block},
  };
  for (size_t i = 0; i < expected.size(); ++i) {
    ASSERT_TRUE(policy.tighten()) << "step " << i;
    EXPECT_EQ(blocks[0]->recompute(), expected[i].first) << "step " << i;
    EXPECT_EQ(blocks[1]->recompute(), expected[i].second) << "step " << i;
    if (i == 4) {
      EXPECT_EQ(policy.describe(),
                "of 2 transformer blocks, 0 recompute their MLP and 1 the whole block, 1 the "
                "whole block but its attention, in backward");
    }
  }
  ASSERT_TRUE(policy.tighten()) << "the last block's MLP in slices";
  EXPECT_EQ(blocks[0]->mlp_parts(), 1);
  EXPECT_EQ(blocks[1]->mlp_parts(), RecomputePolicy::kMlpParts);
  EXPECT_EQ(policy.sliced_mlps(), 1);
  EXPECT_EQ(policy.describe(),
            "of 2 transformer blocks, 0 recompute their MLP and 2 the whole block in backward, "
            "the MLPs of the last 1 in 2 slices of the batch at a time");
  ASSERT_TRUE(policy.tighten()) << "then the first's";
  for (const auto& b : blocks) EXPECT_EQ(b->mlp_parts(), RecomputePolicy::kMlpParts);
  EXPECT_EQ(policy.describe(),
            "of 2 transformer blocks, 0 recompute their MLP and 2 the whole block in backward, "
            "their MLPs in 2 slices of the batch at a time");
  EXPECT_FALSE(policy.tighten());
}

// The job's last step comes after every block recomputes whole (and its
// MLP in slices), and only for a model with blocks, taken again at each
// step more until it frees nothing (the job's frees an eighth of its
// optimizer's state each time); then it is not asked again. The log names
// it when it freed something, in the job's words where it gives them.
TEST(RecomputePolicySteps, TheLastStepIsTakenUntilItFreesNothing) {
  E::nn::Sequential net;
  net.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 1));
  int calls = 0;
  RecomputePolicy policy(
      net, nullptr, [&] { return ++calls <= 3; }, /*offload=*/false,
      [&] { return "and " + std::to_string(calls) + " parts of the state are elsewhere"; });
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(policy.tighten());
  EXPECT_EQ(calls, 0) << "blocks first";
  EXPECT_FALSE(policy.took_last_step());
  EXPECT_TRUE(policy.tighten());
  EXPECT_EQ(calls, 1);
  EXPECT_TRUE(policy.took_last_step());
  EXPECT_NE(policy.describe().find(", and 1 parts of the state are elsewhere"), std::string::npos)
      << policy.describe();
  EXPECT_TRUE(policy.tighten());
  EXPECT_TRUE(policy.tighten());
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(policy.last_steps(), 3);
  EXPECT_FALSE(policy.tighten()) << "nothing is left: the last step freed nothing";
  EXPECT_EQ(calls, 4);
  EXPECT_FALSE(policy.tighten());
  EXPECT_EQ(calls, 4) << "not asked again";
  EXPECT_EQ(policy.last_steps(), 3);
  EXPECT_TRUE(policy.took_last_step());

  // Without words of the job's, the log's own.
  E::nn::Sequential worded;
  worded.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 1));
  RecomputePolicy own(worded, nullptr, [n = 0]() mutable { return ++n == 1; });
  for (int i = 0; i < 5; ++i) EXPECT_TRUE(own.tighten());
  EXPECT_NE(own.describe().find("the optimizer's state is in host memory"), std::string::npos)
      << own.describe();

  E::nn::Sequential fresh;
  fresh.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 1));
  int asked = 0;
  RecomputePolicy nothing_freed(fresh, nullptr, [&] {
    ++asked;
    return false;
  });
  for (int i = 0; i < 4; ++i) EXPECT_TRUE(nothing_freed.tighten());
  EXPECT_FALSE(nothing_freed.tighten()) << "a last step that freed nothing is no step";
  EXPECT_EQ(asked, 1);
  EXPECT_FALSE(nothing_freed.took_last_step());
  EXPECT_FALSE(nothing_freed.tighten());
  EXPECT_EQ(asked, 1) << "asked once";

  E::nn::Sequential no_blocks;
  no_blocks.push_back(std::make_shared<E::nn::Linear>(4, 4));
  int plain_calls = 0;
  RecomputePolicy plain(no_blocks, nullptr, [&] { return ++plain_calls > 0; });
  EXPECT_FALSE(plain.tighten());
  EXPECT_EQ(plain_calls, 0) << "a model without blocks spills alone";
}

// A step whose backward spilled its own recomputed activations: the
// blocks that recompute whole (but their attention or not) go to their
// two halves at once (one step), and from then on MLP-only blocks go to
// halves, never further; the
// last step still comes once every block recomputes something beyond its
// MLP. A step that spilled only forward tensors takes the plain order.
TEST(RecomputePolicySteps, ABackwardOverTheBudgetTurnsWholeBlocksIntoHalves) {
  E::nn::Sequential net;
  for (int i = 0; i < 3; ++i) {
    net.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 3));
  }
  int last = 0;
  RecomputePolicy policy(net, nullptr, [&] { return ++last == 1; });
  using Step = RecomputePolicy::Step;
  RecomputePolicy::Outcome forward_spilled{/*spilled=*/true, false, false};
  RecomputePolicy::Outcome backward_spilled{true, /*working_set_spilled=*/true, false};
  for (int i = 0; i < 3; ++i) EXPECT_EQ(policy.after(forward_spilled), Step::Spilled);
  EXPECT_EQ(policy.mlps(), 1);
  EXPECT_EQ(policy.but_attention(), 1)
      << "the plain order: every MLP but the last block's, then whole blocks but their "
         "attention";
  EXPECT_EQ(policy.whole(), 0);
  EXPECT_EQ(policy.halves(), 0);

  EXPECT_EQ(policy.after(backward_spilled), Step::WorkingSetSpilled);
  EXPECT_EQ(policy.but_attention(), 0);
  EXPECT_EQ(policy.halves(), 1) << "the whole block went to halves, as one step";
  EXPECT_EQ(policy.mlps(), 1) << "and nothing else moved in that step";
  EXPECT_NE(policy.describe().find("1 its two halves apart"), std::string::npos)
      << policy.describe();
  EXPECT_EQ(policy.reason(Step::WorkingSetSpilled),
            "the step spilled, its backward's own recomputed activations among them");
  EXPECT_EQ(policy.reason(Step::Spilled), "the step spilled to stay within the memory budget");
  EXPECT_EQ(policy.reason(Step::GraphDidNotFit), "the step's CUDA graph did not fit in memory");

  EXPECT_EQ(policy.after(forward_spilled), Step::Spilled);
  EXPECT_EQ(policy.halves(), 2) << "an MLP-only block goes to halves, not whole";
  EXPECT_EQ(policy.after(backward_spilled), Step::WorkingSetSpilled);
  EXPECT_EQ(policy.mlps(), 1) << "the last block's MLP, last";
  EXPECT_EQ(policy.after(forward_spilled), Step::Spilled);
  EXPECT_EQ(policy.halves(), 3);
  EXPECT_EQ(policy.whole(), 0);
  EXPECT_FALSE(policy.mlps_sliced());
  for (int i = 1; i <= 3; ++i) {
    EXPECT_EQ(policy.after(forward_spilled), Step::Spilled);
    EXPECT_EQ(policy.sliced_mlps(), i) << "then the MLPs in slices, one block at a time";
  }
  EXPECT_EQ(last, 0);
  EXPECT_EQ(policy.after(forward_spilled), Step::Spilled);
  EXPECT_EQ(last, 1) << "then the last step";
  EXPECT_EQ(policy.after(backward_spilled), Step::None) << "nothing is left";
  EXPECT_EQ(policy.after(forward_spilled), Step::None);
  EXPECT_EQ(policy.whole() + policy.but_attention(), 0) << "never whole again";

  // Every block whole (with and without its attention's output): the
  // MLPs in slices come first; then both go to halves in the same step.
  E::nn::Sequential two;
  add_blocks(two, 2);
  RecomputePolicy whole_first(two, nullptr);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(whole_first.after(forward_spilled), Step::Spilled);
  EXPECT_EQ(whole_first.whole(), 1);
  EXPECT_EQ(whole_first.but_attention(), 1);
  for (int i = 1; i <= 2; ++i) {
    EXPECT_EQ(whole_first.after(backward_spilled), Step::WorkingSetSpilled);
    EXPECT_EQ(whole_first.sliced_mlps(), i);
    EXPECT_EQ(whole_first.halves(), 0);
  }
  EXPECT_EQ(whole_first.after(backward_spilled), Step::WorkingSetSpilled);
  EXPECT_EQ(whole_first.halves(), 2);
  EXPECT_EQ(whole_first.after(forward_spilled), Step::None) << "nothing is left";
}

// A working set over the budget once every block recomputes whole (but
// its attention or not): the MLPs in slices, then the last step come
// first (they free memory in backward without recomputing more, and the
// last step in forward too; halves keep more in forward), then halves,
// then nothing. While a block still keeps its attention half, halves
// come at once, as ever.
TEST(RecomputePolicySteps, EveryBlockWholeTakesTheLastStepBeforeHalves) {
  E::nn::Sequential net;
  add_blocks(net, 2);
  int calls = 0;
  RecomputePolicy policy(net, nullptr, [&] { return ++calls == 1; });
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(policy.tighten());
  ASSERT_EQ(policy.whole(), 1);
  ASSERT_EQ(policy.but_attention(), 1);
  for (int i = 1; i <= 2; ++i) {
    EXPECT_TRUE(policy.tighten(/*working_set_over=*/true));
    EXPECT_EQ(policy.sliced_mlps(), i) << "the MLPs in slices, not halves";
    EXPECT_EQ(calls, 0);
    EXPECT_EQ(policy.halves(), 0);
  }
  EXPECT_TRUE(policy.tighten(/*working_set_over=*/true));
  EXPECT_EQ(calls, 1) << "the last step, not halves";
  EXPECT_EQ(policy.halves(), 0);
  EXPECT_TRUE(policy.tighten(/*working_set_over=*/true));
  EXPECT_EQ(policy.halves(), 2) << "then both blocks in halves, as one step";
  EXPECT_EQ(calls, 2) << "once the last step freed nothing more";
  EXPECT_FALSE(policy.tighten(/*working_set_over=*/true));
  EXPECT_EQ(calls, 2);

  E::nn::Sequential early;
  add_blocks(early, 2);
  int early_calls = 0;
  RecomputePolicy at_once(early, nullptr, [&] { return ++early_calls > 0; });
  for (int i = 0; i < 2; ++i) ASSERT_TRUE(at_once.tighten());
  ASSERT_EQ(at_once.but_attention(), 1);
  EXPECT_TRUE(at_once.tighten(/*working_set_over=*/true));
  EXPECT_EQ(early_calls, 0) << "a block keeps its attention half: halves at once";
  EXPECT_EQ(at_once.halves(), 1);

  // A last step that frees nothing is no step: halves in the same call.
  E::nn::Sequential freeing_nothing;
  add_blocks(freeing_nothing, 2);
  int asked = 0;
  RecomputePolicy nothing(freeing_nothing, nullptr, [&] {
    ++asked;
    return false;
  });
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(nothing.tighten());
  ASSERT_EQ(nothing.sliced_mlps(), 2);
  EXPECT_TRUE(nothing.tighten(/*working_set_over=*/true));
  EXPECT_EQ(asked, 1);
  EXPECT_EQ(nothing.halves(), 2);
}

// Where inputs may go to host memory, a block that comes to recompute
// from its input (whole, but its attention or not) keeps that input there
// from the same step on, from the first block on, but never the last two
// blocks' then; a block recomputing its MLP alone reads no input again
// and keeps its own. Once every block recomputes whole: the MLPs in
// slices, from the last block on; then the input of the block before the
// last, never the last block's; then the last step; only then halves, as
// whole blocks in halves (one input a block, which keeps going to host
// memory). Without the option, no inputs go.
TEST(RecomputePolicySteps, BlocksKeepTheirInputsOnTheHostOnceTheyRecomputeFromThemButTheLastNever) {
  E::nn::Sequential net;
  add_blocks(net, 6);
  int calls = 0;
  RecomputePolicy policy(net, nullptr, [&] { return ++calls == 1; }, /*offload=*/true);
  auto offloading = [&] {
    std::vector<bool> out;
    for (const auto& child : net.children()) {
      out.push_back(dynamic_cast<E::nn::TransformerBlock&>(*child).offload() !=
                    E::nn::TransformerBlock::Offload::None);
    }
    return out;
  };
  for (int i = 0; i < 5; ++i) ASSERT_TRUE(policy.tighten());
  ASSERT_EQ(policy.mlps(), 5) << "the last block's comes last";
  EXPECT_EQ(policy.offloaded(), 0) << "an MLP run again reads no input";
  ASSERT_TRUE(policy.tighten(/*working_set_over=*/true));
  EXPECT_EQ(policy.but_attention(), 1) << "a working set over the budget: no halves yet";
  EXPECT_EQ(policy.halves(), 0);
  EXPECT_EQ(policy.offloaded(), 1) << "its input goes with it, in the same step";
  EXPECT_EQ(offloading(), (std::vector<bool>{true, false, false, false, false, false}));
  EXPECT_NE(policy.describe().find("1 block keeps its input in host memory"), std::string::npos)
      << policy.describe();
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(policy.tighten());
  EXPECT_EQ(policy.but_attention(), 4);
  EXPECT_EQ(policy.offloaded(), 4);
  ASSERT_TRUE(policy.tighten());
  EXPECT_EQ(policy.but_attention(), 5);
  EXPECT_EQ(offloading(), (std::vector<bool>{true, true, true, true, false, false}))
      << "not the last two blocks' yet";
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(policy.tighten(/*working_set_over=*/i % 2 == 0));
  ASSERT_EQ(policy.whole(), 6);
  EXPECT_EQ(policy.offloaded(), 4) << "whole blocks keep theirs there";
  EXPECT_FALSE(policy.mlps_sliced());
  for (int i = 1; i <= 6; ++i) {
    ASSERT_TRUE(policy.tighten(/*working_set_over=*/i % 2 == 0));
    EXPECT_EQ(policy.sliced_mlps(), i) << "then the MLPs in slices";
    EXPECT_EQ(policy.offloaded(), 4);
  }
  ASSERT_TRUE(policy.tighten());
  EXPECT_EQ(offloading(), (std::vector<bool>{true, true, true, true, true, false}))
      << "then the block before the last's input, never the last block's";
  EXPECT_EQ(calls, 0) << "the inputs before the last step";
  ASSERT_TRUE(policy.tighten(/*working_set_over=*/true));
  EXPECT_EQ(calls, 1) << "then the last step";
  EXPECT_EQ(policy.halves(), 0);
  ASSERT_TRUE(policy.tighten(/*working_set_over=*/true));
  EXPECT_EQ(policy.blocks_in_halves(), 6) << "then whole blocks in halves, one input a block";
  EXPECT_EQ(policy.halves(), 0);
  EXPECT_EQ(policy.offloaded(), 5);
  EXPECT_NE(policy.describe().find("6 the whole block in halves"), std::string::npos)
      << policy.describe();
  EXPECT_FALSE(policy.tighten(/*working_set_over=*/true));
  EXPECT_FALSE(policy.tighten());

  E::nn::Sequential plain_net;
  add_blocks(plain_net, 3);
  RecomputePolicy plain(plain_net, nullptr, [n = 0]() mutable { return ++n == 1; });
  for (int i = 0; i < 13; ++i) ASSERT_TRUE(plain.tighten());
  EXPECT_FALSE(plain.tighten());
  EXPECT_EQ(plain.offloaded(), 0);
}

// A block set to keep its input in host memory counts as keeping it there
// once a step's forward put it there (a job's result says so): not before,
// and not where the host memory was short (none here, on the CPU).
TEST(RecomputePolicySteps, AnInputCountsAsInHostMemoryOnceAStepPutItThere) {
  E::nn::Sequential net;
  add_blocks(net, 2);
  RecomputePolicy policy(net, nullptr, {}, /*offload=*/true);
  while (policy.offloaded() == 0) ASSERT_TRUE(policy.tighten(/*working_set_over=*/true));
  EXPECT_EQ(policy.offloaded(), 1);
  EXPECT_EQ(policy.offloaded_in_host_memory(), 0) << "no step has run since";
  E::manual_seed(3);
  const E::Tensor x = E::randn({2, 8, 16}).set_requires_grad(true);
  const E::Tensor step = E::zeros({}, {E::DType::Int64, E::Device::cpu()});
  E::Tensor out;
  {
    E::StepRandom random(1, step);
    out = net(x);
  }
  E::sum(out).backward();
  EXPECT_EQ(policy.offloaded_in_host_memory(), 1);
  EXPECT_EQ(policy.offloads_short_of_memory(), 0);
}

// A working set over the budget before any block recomputes whole (a
// step ran out of memory during a recomputed MLP's backward: run_step asks
// so): MLPs first as ever, then halves, never whole (then the MLPs in
// slices).
TEST(RecomputePolicySteps, AWorkingSetOverTheBudgetEarlyMeansHalvesFromThenOn) {
  E::nn::Sequential net;
  net.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 1));
  RecomputePolicy policy(net, nullptr);
  EXPECT_TRUE(policy.tighten(/*working_set_over=*/true));
  EXPECT_EQ(policy.mlps(), 1);
  EXPECT_TRUE(policy.tighten());
  EXPECT_EQ(policy.halves(), 1);
  EXPECT_EQ(policy.whole(), 0);
  EXPECT_TRUE(policy.tighten());
  EXPECT_TRUE(policy.mlps_sliced());
  EXPECT_EQ(policy.halves(), 1);
  EXPECT_FALSE(policy.tighten());
}

// run_step: a step that runs out of memory runs again with one step more
// each time, while the caller says the attempt changed nothing and a step
// is left; any other error, or an attempt that changed something, stands
// at once, and so does running out with nothing left to recompute.
TEST(RecomputePolicySteps, AStepThatRanOutOfMemoryRunsAgainWhileAStepIsLeft) {
  E::nn::Sequential net;
  net.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 1));
  RecomputePolicy policy(net, nullptr);
  int runs = 0;
  auto fails_until = [&](int ok_on) {
    return [&runs, ok_on] {
      if (++runs < ok_on) throw E::OutOfMemoryError("out of memory (test)", 1);
    };
  };
  auto unchanged = [] { return true; };
  std::vector<std::string> heard;
  EXPECT_EQ(policy.run_step(fails_until(2), unchanged,
                            [&](const E::OutOfMemoryError& e) { heard.push_back(e.what()); }),
            1);
  EXPECT_EQ(policy.mlps(), 1);
  EXPECT_EQ(heard, std::vector<std::string>{"out of memory (test)"});
  runs = 0;
  EXPECT_THROW(policy.run_step(fails_until(2), [] { return false; }), E::OutOfMemoryError);
  EXPECT_EQ(policy.mlps(), 1) << "an attempt that changed something is not run again";
  EXPECT_THROW(policy.run_step([] { throw std::runtime_error("not memory"); }, unchanged),
               std::runtime_error);
  EXPECT_EQ(policy.whole() + policy.but_attention(), 0)
      << "only running out of memory takes a step";
  runs = 0;
  EXPECT_THROW(policy.run_step(fails_until(5), unchanged), E::OutOfMemoryError);
  EXPECT_EQ(policy.whole(), 1) << "the three steps left were taken, and the step failed again";
  EXPECT_TRUE(policy.mlps_sliced());
  EXPECT_EQ(runs, 4);

  // A tensor larger than the whole budget: no step makes it fit.
  E::nn::Sequential other;
  other.push_back(std::make_shared<E::nn::TransformerBlock>(16, 2, 0.0, 1));
  RecomputePolicy fresh(other, nullptr);
  runs = 0;
  EXPECT_THROW(fresh.run_step(
                   [&] {
                     ++runs;
                     throw E::OutOfMemoryError("larger than the budget (test)", 1, true);
                   },
                   unchanged),
               E::OutOfMemoryError);
  EXPECT_EQ(runs, 1);
  EXPECT_EQ(fresh.mlps() + fresh.whole(), 0);
}

}  // namespace
}  // namespace leasehold::testing
