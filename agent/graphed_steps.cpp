#include "agent/graphed_steps.h"

#include <spdlog/spdlog.h>

#include <thread>

#include "agent/engine/autograd.h"
#include "shared/units.h"

namespace leasehold {

namespace E = engine;

GraphedSteps::GraphedSteps(E::Device device, Step step, Options options)
    : device_(device),
      step_(std::move(step)),
      options_(std::move(options)),
      owner_(std::this_thread::get_id()) {
  if (!options_.enabled) return;
  allocator_ = E::current_allocator(device_);
  allocator_->set_idle_release([this](uint64_t) { return release_idle(); });
}

GraphedSteps::~GraphedSteps() {
  if (allocator_) allocator_->set_idle_release({});
  graph_.reset();  // (waits for its last launch before its inputs go)
}

bool GraphedSteps::wanted(const E::Tensor& x) const {
  if (!options_.enabled || dropped_ || failed_ || steps_run_ == 0) return false;
  if (graph_) return x.sizes() == x_.sizes();
  if (did_not_fit_) return false;
  return x.size(0) == options_.full_batch;
}

E::Tensor GraphedSteps::run(const E::Tensor& x, const E::Tensor& y) {
  if (x.size(0) == options_.full_batch) full_batch_seen_ = true;
  const bool graphed = wanted(x);
  if (!graphed && graph_ && x.sizes() != x_.sizes()) {
    // Another shape (the epoch's last batch) runs in the graph's memory,
    // not beside it. (The step drops the last gradients first anyway.)
    if (options_.release) options_.release();
    release_idle();
  }
  E::Tensor loss = graphed ? launch(x, y) : step_(x, y);
  ++steps_run_;
  return loss;
}

E::Tensor GraphedSteps::launch(const E::Tensor& x, const E::Tensor& y) {
  // (Until the graph has run, nothing of it is idle to release.)
  struct InGraphRun {
    bool& flag;
    explicit InGraphRun(bool& f) : flag(f) { flag = true; }
    ~InGraphRun() { flag = false; }
  } in_run(in_graph_run_);
  for (;;) {
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
    // (The batch may have been gathered into them: input_tensors().)
    if (x.raw_data() != x_.raw_data()) x_.copy_(x);
    if (y.raw_data() != y_.raw_data()) y_.copy_(y);
    if (graph_->run()) return loss_;
    const bool out_of_memory = graph_->ran_out_of_memory();
    const std::string why = graph_->why_not();
    forget_graph();
    // A step that needs less is traced again at once: a trace takes
    // milliseconds, where a step op by op that spills takes tens of them.
    if (out_of_memory && options_.need_less && options_.need_less(why)) continue;
    // Op by op from now on, unless the step's memory did not fit: a step
    // that needs less may (the caller's retry()).
    (out_of_memory ? did_not_fit_ : failed_) = true;
    spdlog::warn("the training step runs op by op: {}", why);
    return step_(x, y);
  }
}

void GraphedSteps::input_tensors(E::Tensor& x, E::Tensor& y) const {
  if (!graph_) return;
  x = x_;
  y = y_;
}

uint64_t GraphedSteps::release_idle() {
  if (!graph_ || in_graph_run_ || !graph_->replaying() ||
      std::this_thread::get_id() != owner_) {
    return 0;
  }
  // Only if the arena goes with the graph: no tensor in it is alive but the
  // graph's own loss, which nothing else holds.
  const bool loss_alone = loss_.defined() && loss_.impl().use_count() == 1 &&
                          loss_.impl()->storage.use_count() == 1;
  if (graph_->pool_tensors() > (loss_alone ? 1u : 0u)) {
    if (spdlog::should_log(spdlog::level::debug)) {  // (the description takes the pool's lock)
      spdlog::debug("the step's CUDA graph keeps its memory: {} of its tensors are alive ({}){}",
                    graph_->pool_tensors(), graph_->describe_pool_tensors(),
                    loss_alone ? ", the loss among them" : "");
    }
    return 0;
  }
  const uint64_t bytes = graph_->pool_bytes();
  forget_graph();  // (waits for its last launch)
  ++releases_;
  spdlog::info("the step's CUDA graph gave its {} up to tensors outside it; it is made again "
               "from the next full batch",
               format_bytes(bytes));
  return bytes;
}

void GraphedSteps::forget_graph() {
  past_launches_ += graph_->launches();
  graph_.reset();
  x_ = y_ = loss_ = E::Tensor();
}

void GraphedSteps::drop() {
  dropped_ = true;
  if (graph_) forget_graph();  // (waits for its last launch)
}

void GraphedSteps::forget() {
  if (graph_) forget_graph();  // (waits for its last launch)
}

int64_t GraphedSteps::graph_steps() const {
  return past_launches_ + (graph_ ? graph_->launches() : 0);
}

}  // namespace leasehold
