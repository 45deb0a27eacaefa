#include "agent/graphed_steps.h"

#include "agent/engine/autograd.h"

namespace leasehold {

namespace E = engine;

GraphedSteps::GraphedSteps(E::Device device, Step step, Options options)
    : device_(device), step_(std::move(step)), options_(std::move(options)) {}

GraphedSteps::~GraphedSteps() {
  graph_.reset();  // (waits for its last launch before its inputs go)
}

bool GraphedSteps::wanted(const E::Tensor& x) const {
  if (!options_.enabled || dropped_ || steps_run_ == 0 ||
      (graph_ && !graph_->why_not().empty())) {
    return false;
  }
  if (graph_) return x.sizes() == x_.sizes();
  if (options_.spilling && options_.spilling()) return false;
  return x.size(0) == options_.full_batch;
}

E::Tensor GraphedSteps::run(const E::Tensor& x, const E::Tensor& y) {
  E::Tensor loss = wanted(x) ? launch(x, y) : step_(x, y);
  ++steps_run_;
  return loss;
}

E::Tensor GraphedSteps::launch(const E::Tensor& x, const E::Tensor& y) {
  if (!graph_) {
    x_ = E::empty(x.sizes(), x.options());
    y_ = E::empty(y.sizes(), y.options());
    graph_ = std::make_unique<E::StepGraph>(
        device_,
        [this] {
          // (Its saved tensors stay where the graph put them.)
          E::SavedTensorHooksGuard no_spill(nullptr);
          loss_ = E::Tensor();  // (its memory may be the new loss's)
          loss_ = step_(x_, y_);
        },
        [this] {
          loss_ = E::Tensor();
          if (options_.release) options_.release();
        });
  }
  x_.copy_(x);
  y_.copy_(y);
  if (!graph_->run()) return step_(x, y);
  return loss_;
}

void GraphedSteps::drop() {
  dropped_ = true;
  if (!graph_) return;
  dropped_launches_ += graph_->launches();
  graph_.reset();  // (waits for its last launch)
  x_ = y_ = loss_ = E::Tensor();
}

int64_t GraphedSteps::graph_steps() const {
  return dropped_launches_ + (graph_ ? graph_->launches() : 0);
}

}  // namespace leasehold
