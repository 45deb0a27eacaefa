#include "agent/engine/recompute.h"

#include <algorithm>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"

namespace leasehold::engine {
namespace {

// Whether a and b are the same elements of the same memory, laid out alike.
bool same_memory(const Tensor& a, const Tensor& b) {
  return a.raw_data() == b.raw_data() && a.dtype() == b.dtype() && a.sizes() == b.sizes() &&
         a.strides() == b.strides() && a.device() == b.device();
}

class RecomputeBackward final : public Node {
 public:
  // x kept as it is, or (`stashed`) in host memory.
  RecomputeBackward(Segment segment, const Tensor& x, std::shared_ptr<OffloadedTensor> stashed,
                    RandomPlace random, std::optional<DType> autocast, int64_t parts,
                    std::vector<Tensor> weights, std::vector<std::pair<Tensor, Tensor>> taken)
      : segment_(std::move(segment)),
        x_(stashed ? SavedTensor() : SavedTensor(x)),
        stashed_(std::move(stashed)),
        x_requires_grad_(x.requires_grad()),
        x_sizes_(x.sizes()),
        x_options_(x.options()),
        random_(std::move(random)),
        autocast_(autocast),
        parts_(parts),
        weights_(std::move(weights)),
        taken_(std::move(taken)) {
    if (parts < 1) throw std::invalid_argument("recompute: parts must be at least 1");
  }
  const char* name() const override { return "RecomputeBackward"; }
  // The input's gradient from its other consumers (a transformer block's
  // MLP: the residual stream's addition) goes into the run again's
  // backward as its input's sum so far, where the segment's first operator
  // on it (the MLP's layer norm) adds it as it writes its own: as in the
  // block that keeps everything, where the sum after would be one more
  // pass over the residual stream's gradient (24 MiB a GPT block). A run
  // in slices takes it slice by slice (a contiguous one only: its slices
  // are then too).
  bool fold_into_input0(const Tensor& sum_so_far) override {
    if (!x_requires_grad_ || sum_so_far.sizes() != x_sizes_ ||
        sum_so_far.dtype() != x_options_.dtype || sum_so_far.device() != x_options_.device ||
        (parts_ > 1 && !sum_so_far.is_contiguous())) {
      return false;
    }
    plus_ = sum_so_far;
    return true;
  }

  std::vector<Tensor> apply(const Tensor& grad) override { return apply_taking(grad); }
  // (`grad` goes into the run again's own backward, which lets it go once
  // its first node has run: see Node::apply_taking. In slices, every
  // slice reads it: it stays to the end.)
  std::vector<Tensor> apply_taking(Tensor grad) override {
    const Tensor plus = std::move(plus_);  // (taken for this call only, whatever happens)
    const bool plus_owned = sum_so_far_owned;
    // The weights' copies for its run again, in one pass (recompute.h),
    // which the run again lets go once it has run: from then on the
    // products that read them hold theirs (and a segment recorded within
    // it the copies it took), as when each product converted its own.
    std::optional<AutocastWeights> copies;
    if (!weights_.empty()) {
      AutocastGuard mode(autocast_);
      copies.emplace(weights_, std::move(taken_));
    }
    AutocastWeights* const made = copies ? &*copies : nullptr;
    Tensor x = (stashed_ ? stashed_->get() : x_.get()).detach();
    const int64_t rows = x.dim() > 0 ? x.size(0) : 1;
    if (parts_ > 1 && rows > 1) {
      return apply_in_parts(x, grad, plus, plus_owned, std::min(parts_, rows), made);
    }
    const bool ran = run_again(x, std::move(grad), plus, plus_owned, made);
    // (Nothing in the segment needs gradients: the sum so far stands.)
    if (!ran) return {plus};
    if (!x_requires_grad_) return {Tensor()};
    // (A segment whose output does not depend on its input sends it
    // nothing: its gradient is the sum so far alone.)
    return {x.grad().defined() ? x.grad() : plus};
  }
  void release_saved() override {
    x_.reset();
    stashed_.reset();
    plus_ = Tensor();
    weights_.clear();
    taken_.clear();
  }

 private:
  // The segment run again on `x` (a detached input, made a leaf that
  // wants gradients where the first one did) and its backward from `grad`,
  // `plus` (may be undefined) x's gradient so far from outside the
  // segment (fold_into_input0), which x's gradient may be written over
  // where `plus_writable` (run_backward_from's leaf_sum_writable); false
  // when nothing in it needs gradients. `copies` (may be null): the
  // weights' copies, let go once the segment has run again.
  bool run_again(Tensor& x, Tensor grad, const Tensor& plus, bool plus_writable,
                 AutocastWeights* copies) {
    if (x_requires_grad_) x.set_requires_grad(true);
    Tensor out;
    {
      EnableGradGuard grad_mode;
      RandomReplay replay(random_);
      AutocastGuard autocast(autocast_);
      out = segment_(x, /*replay=*/true);
    }
    if (copies) copies->release();
    // The input the next segment in backward needs comes in from host
    // memory (host_offload.h) while this one's backward runs, the whole of
    // it, to hide the copy: fetched once the block's MLP had run its
    // backward, only the attention's backward was left to hide it, and
    // the GPT job at 25% of its peak ran at 71.5% of unconstrained speed
    // against 73.2% (the fetched input, on the device beside the MLP's
    // peak, made the policy send one block's input more to host memory).
    // A nested segment, or a slice after the first, finds it on its way in
    // already (one at a time).
    offload_prefetch_next();
    if (!out.requires_grad()) return false;
    if (out.sizes() != grad.sizes()) {
      throw std::logic_error("recomputed segment gave " + out.shape_str() + " for " +
                             x.shape_str() + ", not " + grad.shape_str() + " as the first time");
    }
    // (Nothing reads its output: its memory goes before backward runs,
    // which needs only the node that made it.)
    std::shared_ptr<Node> root = out.grad_fn();
    if (root) {
      out = Tensor();
      run_backward_from(std::move(root), std::move(grad), /*retain_graph=*/false, x, plus,
                        plus_writable);
    } else {
      // (A leaf: the segment gave x back, whose gradient is then the sum
      // so far and `grad`, added in the order the engine adds them; or
      // another leaf, a parameter, whose gradient is `grad` alone: x's is
      // then the sum so far.)
      const bool gave_x = out.impl() == x.impl();
      run_backward(out, gave_x && plus.defined() ? add(plus, grad) : grad,
                   /*retain_graph=*/false);
    }
    return true;
  }

  // The segment's run again and its backward over `parts` slices of x's
  // first dimension, one after another (recompute.h); x's gradient is
  // gathered slice by slice, each with its slice of `plus` (may be
  // undefined; contiguous) as run_again's. `plus_owned`: nothing else
  // reads plus (Node::sum_so_far_owned), so the gradient is gathered into
  // its memory, each slice's over the slice of plus it includes: a GPT
  // block's MLP then needs no other 24 MiB beside the residual stream's
  // gradient at its peak; and the slice's first operator on x (the MLP's
  // layer norm) writes it there itself, where a copy after would be one
  // more pass (12 MiB each way a slice of a GPT MLP).
  // `copies` as run_again's: let go after the last slice has run again.
  std::vector<Tensor> apply_in_parts(const Tensor& x, const Tensor& grad, const Tensor& plus,
                                     bool plus_owned, int64_t parts, AutocastWeights* copies) {
    const int64_t rows = x.size(0);
    if (grad.dim() == 0 || grad.size(0) != rows) {
      throw std::logic_error("recomputed segment in parts: its gradient " + grad.shape_str() +
                             " has not the " + std::to_string(rows) + " rows of its input");
    }
    Tensor dx;
    if (x_requires_grad_) dx = plus_owned && plus.defined() ? plus : empty(x.sizes(), x.options());
    const bool gathered_into_plus = dx.defined() && plus.defined() && dx.impl() == plus.impl();
    for (int64_t part = 0, first = 0; part < parts; ++part) {
      const int64_t count = (rows - first) / (parts - part);
      Tensor xs = x.narrow(0, first, count).detach();
      const Tensor plus_slice = plus.defined() ? plus.narrow(0, first, count) : Tensor();
      {
        // (A parameter's gradient is whole after the last slice: only then
        // is it ready, for a data-parallel job's all-reduce.)
        std::optional<GradientReadyGuard> not_yet;
        if (part + 1 < parts) not_yet.emplace(GradientReadyHook());
        if (!run_again(xs, grad.narrow(0, first, count).contiguous(), plus_slice,
                       gathered_into_plus, part + 1 == parts ? copies : nullptr)) {
          // (What needs gradients does not change between slices.)
          if (part > 0) throw std::logic_error("recomputed segment: a slice needs no gradients");
          return {plus};
        }
      }
      if (x_requires_grad_) {
        NoGradGuard no_grad;
        // (No gradient: the slice's output did not depend on it; gathered
        // into plus, that slice of it is in place already.)
        const Tensor g = xs.grad();
        Tensor place = dx.narrow(0, first, count);
        if (g.defined()) {
          // (Written in place already where its operator took plus.)
          if (!same_memory(g, place)) place.copy_(g);
        } else if (!plus_slice.defined()) {
          place.copy_(zeros(xs.sizes(), xs.options()));
        } else if (!gathered_into_plus) {
          place.copy_(plus_slice);
        }
      }
      first += count;
    }
    return {dx};
  }

  Segment segment_;
  SavedTensor x_;
  std::shared_ptr<OffloadedTensor> stashed_;
  bool x_requires_grad_;
  Shape x_sizes_;
  TensorOptions x_options_;
  RandomPlace random_;  // (holds the step counter, read where the masks are drawn)
  std::optional<DType> autocast_;
  int64_t parts_;
  std::vector<Tensor> weights_;  // (parameters: the module holds them too)
  // Copies of weights_ made for the run again this was recorded in.
  std::vector<std::pair<Tensor, Tensor>> taken_;
  Tensor plus_;                  // fold_into_input0's, until apply
};

// The copies of `weights` that a run again in backward made (an enclosing
// segment's, recompute.h), for a segment recorded within it to take: none
// in forward, where the step's copies would be held until backward.
std::vector<std::pair<Tensor, Tensor>> take_copies(const std::vector<Tensor>& weights) {
  const AutocastWeights* copies = autocast_weights();
  if (weights.empty() || !in_backward() || !copies) return {};
  return copies->copies_of(weights);
}

}  // namespace

Tensor recompute_in_backward(const Segment& segment, const Tensor& x, OffloadSlot* offload,
                             int64_t parts, const std::vector<Tensor>& weights) {
  std::optional<RandomPlace> random = RandomPlace::here();
  if (!grad_enabled() || !random) return segment(x, false);
  std::optional<DType> autocast = autocast_dtype(x.device());
  // (Its copy out starts before the segment's kernels, to overlap them.)
  std::shared_ptr<OffloadedTensor> stashed = offload ? offload->stash(x) : nullptr;
  Tensor out;
  {
    NoGradGuard no_grad;
    out = segment(x, false);
  }
  // Recorded whenever grad mode is on: without an input that needs
  // gradients, the segment's parameters may.
  record(out,
         std::make_shared<RecomputeBackward>(segment, x, std::move(stashed), std::move(*random),
                                             autocast, parts, weights, take_copies(weights)),
         {&x});
  return out;
}

Tensor record_for_backward(const Segment& segment, const Tensor& x, const SegmentOutput& output,
                           int64_t parts, const std::vector<Tensor>& weights) {
  std::optional<RandomPlace> random = RandomPlace::here();
  if (!grad_enabled() || !random) {
    return recompute_in_backward(segment, x, nullptr, parts, weights);
  }
  Tensor out = empty(output.sizes, output.options);
  record(out,
         std::make_shared<RecomputeBackward>(segment, x, nullptr, std::move(*random),
                                             autocast_dtype(x.device()), parts, weights,
                                             take_copies(weights)),
         {&x});
  return out;
}

}  // namespace leasehold::engine
