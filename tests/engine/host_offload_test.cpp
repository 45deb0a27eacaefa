// Inputs kept in host memory between forward and backward
// (host_offload.h), on the CPU, where the copies are made at once and the
// bookkeeping is the GPU's: what leaves, what a slot holds, what a second
// forward before backward does, and a segment's gradients through it.
// (The GPU's copies and a step captured with them: engine_cuda_test.)
#include "agent/engine/host_offload.h"

#include <gtest/gtest.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"
#include "agent/engine/recompute.h"
#include "tests/engine/counting_allocator.h"

namespace leasehold::engine {
namespace {

Tensor counting(int64_t n, float from) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = from + static_cast<float>(i);
  return from_vector(v, {n});
}

std::weak_ptr<Storage> storage_of(const Tensor& t) { return t.impl()->storage; }

// Forward goes on past enough blocks for what was stashed to leave.
void blocks_go_by() {
  for (uint64_t i = 0; i < kOffloadReleaseAfterBlocks; ++i) offload_progress();
}

TEST(HostOffload, AStashedTensorLeavesItsMemoryAndComesBackTheSame) {
  OffloadSlot slot;
  Tensor x = counting(1000, 1);
  const std::vector<float> values = x.to_vector<float>();
  std::weak_ptr<Storage> memory = storage_of(x);
  auto h = slot.stash(x);
  ASSERT_TRUE(h->offloaded());
  EXPECT_EQ(slot.host_bytes(), 4000u);
  x = Tensor();
  // (Its copy out overlaps the blocks after it: its memory goes once
  // forward is past kOffloadReleaseAfterBlocks of them.)
  for (uint64_t i = 1; i < kOffloadReleaseAfterBlocks; ++i) offload_progress();
  EXPECT_FALSE(memory.expired()) << "let go before forward went past "
                                 << kOffloadReleaseAfterBlocks << " blocks";
  offload_progress();
  EXPECT_TRUE(memory.expired()) << "the handle holds the tensor's memory";

  Tensor back = h->get();
  EXPECT_EQ(back.sizes(), (Shape{1000}));
  EXPECT_EQ(back.dtype(), DType::Float32);
  EXPECT_EQ(back.to_vector<float>(), values);
  // Again (a backward with retain_graph): copied in again, the same.
  back = Tensor();
  EXPECT_EQ(h->get().to_vector<float>(), values);
}

TEST(HostOffload, ASlotStillClaimedKeepsTheNextTensorOnItsDevice) {
  OffloadSlot slot;
  Tensor x = counting(8, 0);
  std::weak_ptr<Storage> x_memory = storage_of(x);
  auto first = slot.stash(x);
  x = Tensor();
  ASSERT_TRUE(first->offloaded());
  // A second forward before the first's backward: its tensor stays where
  // it is, and the first's values are not overwritten.
  Tensor y = counting(8, 100);
  std::weak_ptr<Storage> y_memory = storage_of(y);
  auto second = slot.stash(y);
  EXPECT_FALSE(second->offloaded());
  y = Tensor();
  blocks_go_by();
  EXPECT_TRUE(x_memory.expired()) << "the first is read from the slot's memory below";
  EXPECT_FALSE(y_memory.expired()) << "a tensor kept on its device is held by its handle";
  EXPECT_EQ(second->get().to_vector<float>(), counting(8, 100).to_vector<float>());
  EXPECT_EQ(first->get().to_vector<float>(), counting(8, 0).to_vector<float>());

  // Once the first's handle is gone, the slot takes the next.
  first.reset();
  auto third = slot.stash(counting(8, 200));
  EXPECT_TRUE(third->offloaded());
  blocks_go_by();
  EXPECT_EQ(third->get().to_vector<float>(), counting(8, 200).to_vector<float>());
  EXPECT_EQ(second->get().to_vector<float>(), counting(8, 100).to_vector<float>());
}

TEST(HostOffload, TheSlotGrowsForALargerTensorAndKeepsItsMemoryForASmaller) {
  OffloadSlot slot;
  slot.stash(counting(16, 0)).reset();
  EXPECT_EQ(slot.host_bytes(), 64u);
  auto larger = slot.stash(counting(64, 5));
  blocks_go_by();
  EXPECT_EQ(slot.host_bytes(), 256u);
  EXPECT_EQ(larger->get().to_vector<float>(), counting(64, 5).to_vector<float>());
  larger.reset();
  auto smaller = slot.stash(counting(3, 9));
  blocks_go_by();
  EXPECT_EQ(slot.host_bytes(), 256u);
  EXPECT_EQ(smaller->get().to_vector<float>(), counting(3, 9).to_vector<float>());
}

TEST(HostOffload, ANonContiguousTensorStaysOnItsDevice) {
  OffloadSlot slot;
  Tensor m = counting(12, 0).view({3, 4}).transpose(0, 1);
  ASSERT_FALSE(m.is_contiguous());
  auto h = slot.stash(m);
  EXPECT_FALSE(h->offloaded());
  EXPECT_EQ(h->get().contiguous().to_vector<float>(), m.contiguous().to_vector<float>());
  // (It claimed nothing: the next contiguous one goes.)
  EXPECT_TRUE(slot.stash(counting(4, 0))->offloaded());
}

// How the second of two_segments_backward's segments nests others.
enum class Nesting {
  None,
  Slices,       // one segment in two slices (a GPT block's MLP)
  TwoSegments,  // one, then one in two slices (a block in halves)
};

// What two_segments_backward saw: the allocations of the first segment's
// input size (its fetches from host memory) counted at each place.
struct Fetches {
  std::vector<int> second, nested, at_wb, first;
  std::vector<std::vector<float>> grads;  // wa's, wb's, x0's
};

// Two segments, the second nesting as asked, their inputs in host memory
// with `offload`, and one backward through them; `fails`: the nested
// segments' run again throws (the backward then throws).
Fetches two_segments_backward(bool offload, Nesting nesting, bool fails = false) {
  const size_t first_input_bytes = 1000 * sizeof(float);  // no other tensor's size
  auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
  int fetched = 0;  // allocations of the first segment's input size
  counting->on_allocate = [&](size_t bytes) { fetched += bytes == first_input_bytes; };
  AllocatorGuard counted(counting);
  manual_seed(7);
  Tensor wa = rand({600}).set_requires_grad(true), wb = rand({600}).set_requires_grad(true);
  Tensor x0 = rand({1000}).set_requires_grad(true);
  Fetches f;
  Segment inner = [&](const Tensor& in, bool replay) {
    if (replay) {
      f.nested.push_back(fetched);
      if (fails) throw std::runtime_error("the nested segment fails (test)");
    }
    return tanh(in);
  };
  Segment weighted = [&](const Tensor& in, bool replay) {
    if (replay) f.nested.push_back(fetched);
    return mul(in, wb);
  };
  Segment first = [&](const Tensor& in, bool replay) {
    if (replay) f.first.push_back(fetched);
    return mul(tanh(in.narrow(0, 0, 600)), wa);
  };
  Segment second = [&](const Tensor& in, bool replay) {
    if (replay) f.second.push_back(fetched);
    switch (nesting) {
      case Nesting::None:
        return tanh(mul(in, wb));
      case Nesting::Slices:
        return recompute_in_backward(inner, mul(in, wb), nullptr, /*parts=*/2);
      case Nesting::TwoSegments:
        return recompute_in_backward(inner, recompute_in_backward(weighted, in), nullptr, 2);
    }
    throw std::logic_error("nesting");
  };
  Tensor step = zeros({}, {DType::Int64, Device::cpu()});
  StepRandom random(3, step);
  OffloadSlot slot_a, slot_b;
  Tensor x = mul(x0, 2.0);  // (not a leaf: the stashed tensor is the only holder)
  Tensor y = recompute_in_backward(first, x, offload ? &slot_a : nullptr);
  x = Tensor();
  Tensor loss = sum(recompute_in_backward(second, y, offload ? &slot_b : nullptr));
  y = Tensor();
  // (Forward went on past enough blocks for both inputs to leave.)
  for (uint64_t i = 0; i < kOffloadReleaseAfterBlocks; ++i) offload_progress();
  fetched = 0;
  // (wb's gradient is ready within the second segment's backward, after
  // the nested one's in slices: the first's input is on its way in then.)
  GradientReadyGuard ready([&](const Tensor& leaf) {
    if (leaf.impl() == wb.impl()) f.at_wb.push_back(fetched);
  });
  loss.backward();
  f.grads = {wa.grad().to_vector<float>(), wb.grad().to_vector<float>(),
             x0.grad().to_vector<float>()};
  return f;
}

// Two segments whose inputs wait in host memory, the second (first in
// backward) with segments of its own recorded within its run again (a GPT
// block's MLP in slices, or a block in halves): the first's input comes in
// once the second has run again, before the nested ones run again (they
// find it on its way in already), and once, before the first's run
// again. The gradients are those of the segments kept on the device.
TEST(HostOffload, TheNextInputComesInOnceTheSegmentHasRunAgainAndOnce) {
  for (Nesting nesting : {Nesting::None, Nesting::Slices, Nesting::TwoSegments}) {
    SCOPED_TRACE(static_cast<int>(nesting));
    const Fetches f = two_segments_backward(true, nesting);
    EXPECT_EQ(f.second, std::vector<int>{0}) << "fetched before the second's replay";
    if (nesting == Nesting::Slices) {
      EXPECT_EQ(f.nested, (std::vector<int>{1, 1}))
          << "not fetched as the second ran again, or fetched again by the slices";
    } else if (nesting == Nesting::TwoSegments) {
      EXPECT_EQ(f.nested, (std::vector<int>{1, 1, 1}));
    }
    EXPECT_EQ(f.at_wb, std::vector<int>{1})
        << "not fetched ahead of the first's run again (or more than once)";
    EXPECT_EQ(f.first, std::vector<int>{1});
    EXPECT_EQ(f.grads, two_segments_backward(false, nesting).grads);
  }
}

// A backward that fails within a nested segment, with the next input on
// its way in, leaves nothing behind for the next step: its fetches come as
// they would have, once its second segment has run again.
TEST(HostOffload, ABackwardFailingInANestedSegmentLeavesTheNextStepsFetchesAlone) {
  EXPECT_THROW(two_segments_backward(true, Nesting::Slices, /*fails=*/true), std::runtime_error);
  const Fetches f = two_segments_backward(true, Nesting::None);
  EXPECT_EQ(f.second, std::vector<int>{0});
  EXPECT_EQ(f.at_wb, std::vector<int>{1}) << "not fetched once the second segment ran again";
  EXPECT_EQ(f.first, std::vector<int>{1});
}

// Three segments whose inputs have not left the device when backward
// begins (forward ended fewer than kOffloadReleaseAfterBlocks blocks after
// them): the last's is read in place, and so is the next one's, which the
// last's backward leaves where it is while it lets the first's go (its
// memory is wanted before backward comes to it); the first's is then
// fetched, once. The gradients are those of the inputs kept on the device.
TEST(HostOffload, InputsStillOnTheDeviceAreReadThereAndOlderOnesLetGoForTheNext) {
  struct Seen {
    std::vector<int> fetched;             // at each replay, in backward order
    std::vector<std::vector<bool>> held;  // the three inputs' memory, then
    std::vector<std::vector<float>> grads;
  };
  auto run = [](bool offload) {
    const int64_t sizes[] = {1000, 900, 800};  // each input's (no other tensor's)
    auto counting = std::make_shared<CountingAllocator>(current_allocator(Device::cpu()));
    int fetched = 0;  // allocations of the first input's size
    counting->on_allocate = [&](size_t bytes) { fetched += bytes == 1000 * sizeof(float); };
    AllocatorGuard counted(counting);
    manual_seed(5);
    std::vector<Tensor> w;
    for (int64_t n : {900, 800, 700}) w.push_back(rand({n}).set_requires_grad(true));
    Tensor x0 = rand({sizes[0]}).set_requires_grad(true);
    Seen seen;
    std::vector<std::weak_ptr<Storage>> inputs(3);
    auto segment = [&](int k) -> Segment {
      return [&, k](const Tensor& in, bool replay) {
        if (replay) {
          seen.fetched.push_back(fetched);
          std::vector<bool> held;
          for (const auto& m : inputs) held.push_back(!m.expired());
          seen.held.push_back(held);
        }
        return mul(tanh(in.narrow(0, 0, w[k].size(0))), w[k]);
      };
    };
    Tensor step = zeros({}, {DType::Int64, Device::cpu()});
    StepRandom random(3, step);
    OffloadSlot slots[3];
    Tensor x = mul(x0, 2.0);  // (not a leaf: the stashed tensor is the only holder)
    for (int k = 0; k < 3; ++k) {
      inputs[k] = storage_of(x);
      x = recompute_in_backward(segment(k), x, offload ? &slots[k] : nullptr);
    }
    Tensor loss = sum(x);
    x = Tensor();
    offload_progress();  // (one block: too few for any to leave)
    for (const auto& m : inputs) EXPECT_FALSE(m.expired()) << "left before forward went on";
    fetched = 0;
    loss.backward();
    for (const Tensor& t : {w[0], w[1], w[2], x0}) seen.grads.push_back(t.grad().to_vector<float>());
    return seen;
  };
  const Seen seen = run(true);
  // The last's replay, the middle's, the first's.
  EXPECT_EQ(seen.fetched, (std::vector<int>{0, 0, 1}))
      << "the first input not fetched once, between the middle's replay and its own";
  ASSERT_EQ(seen.held.size(), 3u);
  EXPECT_EQ(seen.held[0], (std::vector<bool>{true, true, true}));
  EXPECT_EQ(seen.held[1], (std::vector<bool>{false, true, false}))
      << "the first's memory not let go as the last's backward came to the middle's";
  EXPECT_EQ(seen.grads, run(false).grads);
}

// A recomputed segment whose input waits in host memory: the gradients of
// the segment kept on the device, through one backward and through two
// with retain_graph; a second backward without it names the mistake.
TEST(HostOffload, ARecomputedSegmentsGradientsAreTheSameWithItsInputOnTheHost) {
  auto run = [](bool offload, int backwards) {
    Tensor w = from_vector<float>({0.5f, -2, 3}, {3}).set_requires_grad(true);
    Tensor x0 = from_vector<float>({1, 2, 3}, {3}).set_requires_grad(true);
    Segment f = [&](const Tensor& in, bool) { return mul(tanh(in), w); };
    Tensor step = zeros({}, {DType::Int64, Device::cpu()});
    StepRandom random(3, step);
    OffloadSlot slot;
    Tensor x = mul(x0, x0);  // (not a leaf: the stashed tensor is the only holder)
    std::weak_ptr<Storage> x_memory = storage_of(x);
    Tensor out = recompute_in_backward(f, x, offload ? &slot : nullptr);
    x = Tensor();
    blocks_go_by();
    if (offload) {
      EXPECT_EQ(slot.host_bytes(), 12u);
      EXPECT_TRUE(x_memory.expired()) << "the input not read back from host memory";
    }
    Tensor loss = sum(out);
    for (int i = 0; i < backwards; ++i) loss.backward({}, /*retain_graph=*/i + 1 < backwards);
    return std::vector<std::vector<float>>{w.grad().to_vector<float>(),
                                           x0.grad().to_vector<float>()};
  };
  EXPECT_EQ(run(true, 1), run(false, 1));
  EXPECT_EQ(run(true, 2), run(false, 2));

  Tensor w = ones({3}).set_requires_grad(true);
  Tensor step = zeros({}, {DType::Int64, Device::cpu()});
  StepRandom random(3, step);
  OffloadSlot slot;
  Tensor x = mul(counting(3, 1), ones({3}).set_requires_grad(true));
  Tensor loss =
      sum(recompute_in_backward([&](const Tensor& in, bool) { return mul(in, w); }, x, &slot));
  x = Tensor();
  blocks_go_by();
  loss.backward();
  EXPECT_THROW(loss.backward(), std::runtime_error);
}

}  // namespace
}  // namespace leasehold::engine
