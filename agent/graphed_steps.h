// A job's training steps, as CUDA graphs where they can be
// (engine/step_graph.h) and op by op where not. The job runner hands it the
// step (forward, backward, clipping, the optimizer) and a batch per step;
// it decides which steps launch a graph:
//   - only on a GPU, when the job allows graphs, and never for
//     data-parallel replicas (their gradients are averaged on the host as
//     backward runs);
//   - not the attempt's first step (it runs op by op: what a step makes
//     once, the optimizer's state, is made outside the graph's memory);
//     then at the first full batch, whether or not the steps before
//     spilled: the graph's step is traced without holding its memory
//     (step_graph.h), so whether it fits is known from its arena alone. A
//     job over its budget thus gets its graph at the first level of its
//     recompute policy whose arena fits (recompute_policy.h), even where
//     the same step op by op spills. The graph's step runs without the
//     spill hooks (its tensors stay in the arena);
//   - only steps of the full batch shape, each copied into the graph's
//     input tensors (an epoch's last, smaller batch runs op by op, in the
//     memory the graph gives up for it: see below);
//   - none once a graph was dropped or failed, except for want of memory
//     (its trace ran out of addresses, or its arena did not fit beside
//     what else is live). Then the step is made to need less
//     (Options::need_less, the job's recompute policy) and traced again at
//     once, for as long as it can need less; where it cannot, the step
//     runs op by op (graph_did_not_fit()), and no graph is tried until
//     retry(): the job runner makes the step need less first, from what
//     that step op by op showed (RecomputePolicy::after_step).
// A Shrink drops the graph between steps: its pool (a step's peak memory,
// the gradients in it) goes back to the allocator, and the rest of the
// attempt runs op by op.
//
// Between its launches the graph's arena holds nothing anyone reads but
// the loss (a step drops the gradients first). So a step of another shape
// (the epoch's last, smaller batch) gets the arena's memory rather than
// as much again beside it, and when memory outside the arena runs short
// within the job's budget (the evaluation) the allocator is given the
// arena first, before any saved tensor spills
// (Allocator::set_idle_release). The graph goes, and is made again from
// the next full batch (traced, laid out and captured again: a few
// milliseconds; the arena lands where it was). It is given up only while
// no tensor in it is alive but the loss (the job drops the gradients
// before it evaluates), and only from the job's own thread, never while
// a graph is being traced, captured or launched.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "agent/engine/step_graph.h"
#include "agent/engine/tensor.h"

namespace leasehold {

class GraphedSteps {
 public:
  // One step on (x, y); returns its loss (on the device).
  using Step = std::function<engine::Tensor(const engine::Tensor& x, const engine::Tensor& y)>;
  struct Options {
    bool enabled = false;  // a GPU job that allows graphs and is no replica
    int64_t full_batch = 0;  // the batch size whose steps are graphed
    // Called when the graph's memory did not fit (`why`: what did not):
    // makes the step need less (the job's recompute policy) and returns
    // whether it did, for the graph to be tried again at once (may be
    // empty: the step runs op by op, and the caller's retry() lets a later
    // step try again).
    std::function<bool(const std::string& why)> need_less;
    // Drops what a step leaves that the next does not read (the gradients,
    // which a step zeroes first): after the graph's trace, whose tensors
    // have no memory behind them and must all be gone before its memory is
    // laid out (step_graph.h). Needed by any step that leaves tensors.
    std::function<void()> release;
  };

  GraphedSteps(engine::Device device, Step step, Options options);
  ~GraphedSteps();
  GraphedSteps(const GraphedSteps&) = delete;
  GraphedSteps& operator=(const GraphedSteps&) = delete;

  // Runs one step, as a graph launch or op by op (see above).
  engine::Tensor run(const engine::Tensor& x, const engine::Tensor& y);
  // The held graph's input tensors, for the next batch to be gathered into
  // (run() then copies nothing); else x and y are left as they are.
  void input_tensors(engine::Tensor& x, engine::Tensor& y) const;
  // Whether a graph (and its pool's memory) is held. (A graph that failed
  // is not: it is forgotten at once.)
  bool holds_graph() const { return graph_ != nullptr; }
  // Drops the graph (waiting for its last launch) and its inputs and loss;
  // steps run op by op from then on. The gradients the graph's pool held
  // are gone: the caller zeroes its optimizer's.
  void drop();
  // Forgets the graph the same way, but a later full batch makes one
  // again: for a change to what the step reads
  // that the captured graph cannot see (the optimizer's state moved, its
  // addresses baked into the graph).
  void forget();
  // Steps run as graph launches so far, a dropped graph's included.
  int64_t graph_steps() const;
  // Times the graph gave its memory up for other tensors (see above).
  int64_t releases() const { return releases_; }
  // Whether the last graph failed because the step's memory did not fit
  // the budget (its trace, or its arena beside what else is live): no
  // graph is made again until retry(), when the step needs less.
  bool graph_did_not_fit() const { return did_not_fit_; }
  // Whether the next full batch's step tries to make a graph (none is
  // held, and none failed for good or waits for retry()): whether a step
  // that spilled op by op may yet fit as a graph.
  // (Never for a job whose batches are all smaller than the full batch.)
  bool graph_pending() const {
    return options_.enabled && full_batch_seen_ && !graph_ && !did_not_fit_ && !failed_ &&
           !dropped_;
  }
  void retry() { did_not_fit_ = false; }

 private:
  bool wanted(const engine::Tensor& x) const;
  // The allocator's idle release (see above): the arena's bytes if it went.
  uint64_t release_idle();
  // Forgets the graph, its inputs and its loss.
  void forget_graph();
  // The step as a graph launch (making the graph first), or op by op where
  // the graph cannot run it.
  engine::Tensor launch(const engine::Tensor& x, const engine::Tensor& y);

  engine::Device device_;
  Step step_;
  Options options_;
  std::unique_ptr<engine::StepGraph> graph_;
  engine::Tensor x_, y_, loss_;  // the graph's inputs and its loss: memory that stays put
  std::shared_ptr<engine::Allocator> allocator_;  // where the idle release is installed
  bool in_graph_run_ = false;  // tracing, capturing or launching: nothing to release
  int64_t steps_run_ = 0;
  int64_t past_launches_ = 0;  // of graphs dropped or released
  int64_t releases_ = 0;
  bool did_not_fit_ = false;
  bool full_batch_seen_ = false;
  bool failed_ = false;  // a graph failed for another reason: op by op for good
  bool dropped_ = false;
  std::thread::id owner_;  // the job's thread: the only one whose allocations release
};

}  // namespace leasehold
