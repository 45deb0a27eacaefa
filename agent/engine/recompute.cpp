#include "agent/engine/recompute.h"

#include <optional>
#include <stdexcept>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"

namespace leasehold::engine {
namespace {

class RecomputeBackward final : public Node {
 public:
  // x kept as it is, or (`stashed`) in host memory.
  RecomputeBackward(Segment segment, const Tensor& x, std::shared_ptr<OffloadedTensor> stashed,
                    RandomPlace random, std::optional<DType> autocast)
      : segment_(std::move(segment)),
        x_(stashed ? SavedTensor() : SavedTensor(x)),
        stashed_(std::move(stashed)),
        x_requires_grad_(x.requires_grad()),
        random_(std::move(random)),
        autocast_(autocast) {}
  const char* name() const override { return "RecomputeBackward"; }

  std::vector<Tensor> apply(const Tensor& grad) override {
    // (The input the next segment in backward needs comes in meanwhile.)
    offload_prefetch_next();
    Tensor x = (stashed_ ? stashed_->get() : x_.get()).detach();
    if (x_requires_grad_) x.set_requires_grad(true);
    Tensor out;
    {
      EnableGradGuard grad_mode;
      RandomReplay replay(random_);
      AutocastGuard autocast(autocast_);
      out = segment_(x, /*replay=*/true);
    }
    if (!out.requires_grad()) return {};  // nothing in it needs gradients
    if (out.sizes() != grad.sizes()) {
      throw std::logic_error("recomputed segment gave " + out.shape_str() + ", not " +
                             grad.shape_str() + " as the first time");
    }
    // (Nothing reads its output: its memory goes before backward runs,
    // which needs only the node that made it.)
    std::shared_ptr<Node> root = out.grad_fn();
    if (root) {
      out = Tensor();
      run_backward_from(std::move(root), grad, /*retain_graph=*/false);
    } else {
      run_backward(out, grad, /*retain_graph=*/false);  // (a leaf: the segment gave x back)
    }
    return {x_requires_grad_ ? x.grad() : Tensor()};
  }
  void release_saved() override {
    x_.reset();
    stashed_.reset();
  }

 private:
  Segment segment_;
  SavedTensor x_;
  std::shared_ptr<OffloadedTensor> stashed_;
  bool x_requires_grad_;
  RandomPlace random_;  // (holds the step counter, read where the masks are drawn)
  std::optional<DType> autocast_;
};

}  // namespace

Tensor recompute_in_backward(const Segment& segment, const Tensor& x, OffloadSlot* offload) {
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
                                             autocast),
         {&x});
  return out;
}

Tensor record_for_backward(const Segment& segment, const Tensor& x, const SegmentOutput& output) {
  std::optional<RandomPlace> random = RandomPlace::here();
  if (!grad_enabled() || !random) return recompute_in_backward(segment, x);
  Tensor out = empty(output.sizes, output.options);
  record(out,
         std::make_shared<RecomputeBackward>(segment, x, nullptr, std::move(*random),
                                             autocast_dtype(x.device())),
         {&x});
  return out;
}

}  // namespace leasehold::engine
