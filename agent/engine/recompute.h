// Trading compute for memory: a segment of the forward pass (a transformer
// block) that keeps only its input for backward and runs again there to
// rebuild what its own backward needs (activation checkpointing, Chen et
// al. 2016, as torch.utils.checkpoint does it). Recomputing a GPT block's
// forward costs about a third of its step; moving the same activations to
// host memory and back costs several times its step on a PCIe link, so a
// job over its memory budget recomputes blocks before it spills
// (agent/job_runner.cpp).
//
// The segment runs again with the random numbers it drew the first time
// (its dropout masks: the StepRandom it ran in, at the same place; tensor.h:
// RandomReplay) and the autocast mode it ran under, so the gradients are
// those of the plain segment, bit for bit, as long as backward runs before
// the optimizer moves the step counter (as for dropout itself). Its
// parameters' gradients are accumulated by the inner backward, as they
// arrive; the input's gradient goes on through the outer graph. So a
// parameter the segment shares with the rest of the model gets its
// gradient in two parts, which a data-parallel job refuses
// (gradient_reducer.h): segments own their parameters.
#pragma once

#include <functional>
#include <vector>

#include "agent/engine/host_offload.h"
#include "agent/engine/tensor.h"

namespace leasehold::engine {

// segment(x, replay): `replay` is true when it runs again in backward,
// where its output's values are never read (only its graph is): it may
// then run its tail, the operators whose outputs feed only its output,
// under an OutputsUnreadGuard (autograd.h), which skips their kernels (a
// transformer block's last product and its dropout's addition).
using Segment = std::function<Tensor(const Tensor& x, bool replay)>;

// segment(x), recorded so that backward runs segment again on x instead of
// keeping its activations. `segment` must be a function of x and of
// parameters that do not change before backward, and what it refers to (a
// module) must outlive the backward pass. Runs segment(x) as it is outside
// grad mode, and outside a StepRandom (its random numbers could not be
// drawn again). In grad mode the result always has a backward node: the
// segment's parameters may need gradients even when x does not. With
// `offload`, x is kept in the slot's host memory rather than on the device
// between forward and backward (host_offload.h).
//
// `parts` > 1: backward runs the segment again over that many slices of x's
// first dimension (a batch's samples) one at a time, each slice's
// backward before the next's forward, so that one slice's activations
// live at once: for a segment that treats each sample apart and draws no
// random numbers (a transformer block's MLP). Its parameters' gradients
// are then sums over the slices (within rounding of the whole batch's,
// not its bits), each leaf's gradient-ready hook called once, after the
// last slice (autograd.h). REQUIRES: parts >= 1.
//
// `weights`: the parameters the segment's products multiply. Under
// autocast their bfloat16 copies (autocast.h: AutocastWeights) are made in
// one pass as its backward starts, read by its run again (all its slices)
// and let go once it has run: the products that read them hold theirs
// from then on, as when each converted its own. A segment recorded
// within a run again takes its weights' copies from there for its own
// backward, which then makes none. A GPT block recomputed whole with its
// MLP in slices converts its weights once, not three times (its
// attention's, then each slice's MLP's), the same bits, with no more
// memory held at its backward's peak.
Tensor recompute_in_backward(const Segment& segment, const Tensor& x,
                             OffloadSlot* offload = nullptr, int64_t parts = 1,
                             const std::vector<Tensor>& weights = {});

// What a segment gave: its output's shape and options.
struct SegmentOutput {
  Shape sizes;
  TensorOptions options;
};

// segment(x) recorded as recompute_in_backward records it, without running
// it now: for a segment within another's run again in backward whose
// output nothing reads there (the MLP of a whole block recomputed in
// halves, or in slices, nn.h), which runs in its own backward only. Returns an
// unwritten tensor shaped as `output` (what the segment gave when it ran
// first) with the segment's node. The segment must draw no random numbers
// (the draws of a first run are not made). Outside grad mode or a
// StepRandom it runs as recompute_in_backward. `parts` and `weights` as
// there.
Tensor record_for_backward(const Segment& segment, const Tensor& x, const SegmentOutput& output,
                           int64_t parts = 1, const std::vector<Tensor>& weights = {});

}  // namespace leasehold::engine
