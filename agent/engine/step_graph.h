// Whole training steps as CUDA graphs: a step of fixed shapes is captured
// once and then launched as one graph, so a step costs one launch instead
// of hundreds (under MPS many small jobs were bound by kernel launches per
// second across clients, not by the GPU).
//
// What makes a step replayable is the caller's part: everything the step
// reads that changes from step to step lives in device memory that stays
// put. The batch is copied into the same input tensors before each run;
// the learning rate, Adam's bias corrections and the dropout masks come
// from the optimizer's step counter on the device (optim.h, StepRandom),
// and the loss stays on the device. Nothing in a step may make the host
// wait for the device.
//
// Memory: every tensor the step makes comes from the graph's own pool
// (GraphPool). The step is first captured only to trace its allocations
// and frees: that capture's graph is thrown away, its kernels never run, so
// its tensors get addresses with no memory behind them (trace_addresses.h)
// and the step's memory is known without the step holding it. The real
// capture then gives each allocation its place in one arena laid out from
// that trace (memory_plan.h), which never serves anything else, so the
// addresses baked into the graph stay valid and unshared as long as it
// lives. Tensors the step leaves behind (gradients, the loss) stay in the
// arena and are rewritten by each launch. The arena holds about as much as
// the step has live at once at its peak (memory_plan.h; for the GPT job
// exactly that), and nothing else: whether a step fits its budget as a
// graph is known from the arena alone, even where the same step op by op
// would not fit (its allocator's blocks and what spills add to its peak).
// A step whose arena does not fit is run op by op (graphed_steps.h says
// what a job then does).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/trace_addresses.h"

namespace leasehold::engine {

// Memory that a graph's step allocates, in three phases:
//   - tracing: each allocation gets an address of a reserved range with no
//     memory behind it (trace_addresses.h; `trace_bytes` of them), and is
//     traced (its size, when it was made and freed); nothing is taken from
//     `upstream`. Running out of addresses is an OutOfMemoryError;
//   - plan(): lays the traced allocations out in one arena taken from
//     `upstream` (memory_plan.h); it throws OutOfMemoryError where the
//     upstream cannot give it. Every traced allocation must have been
//     freed by then (std::logic_error otherwise: a tensor with no memory
//     behind it would outlive its trace); those alive at the trace's end
//     are live to the step's end;
//   - capturing: the step runs again and makes the same allocations in the
//     same order; each gets its planned place. One that differs from the
//     trace's, or that comes while a tensor the trace had freed by then is
//     still alive (the two may share bytes), throws std::runtime_error,
//     and capture_mismatch() names a capture that made fewer (the capture
//     is abandoned). Nothing is taken from `upstream` then.
// The arena returns upstream when the pool goes (when no tensor it made is
// alive any more). After the capture it serves no more allocations.
// Upstream is called without the pool's lock held.
class GraphPool final : public Allocator {
 public:
  GraphPool(std::shared_ptr<Allocator> upstream, uint64_t trace_bytes);
  ~GraphPool() override;
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) noexcept override;
  Device device() const override { return upstream_->device(); }
  // in_use: handed out now; cached: the arena's rest; allocations: calls so far.
  AllocatorStats stats() const override;
  void plan();
  void set_capturing(bool capturing);
  // "" when the capture made every allocation its trace did; else why not.
  std::string capture_mismatch() const;
  // Bytes taken from upstream: the arena (none while tracing).
  uint64_t held_bytes() const;
  // The most bytes the traced step had live at once (0 before plan()).
  uint64_t peak_live_bytes() const;
  // Tensors it made that are alive now.
  size_t live_allocations() const;
  // Those tensors for the debug log, largest first: "2 x 12.00 MiB (made
  // in LinearBackward's backward, events 240, 251 of 758), ...".
  std::string describe_live() const;

 private:
  enum class Phase { Tracing, Planned, Capturing, Captured };
  void* place_captured(size_t bytes);  // REQUIRES: mu_ held
  struct Traced {
    size_t bytes;
    uint64_t first, last;  // events; last = UINT64_MAX while live
    // Where it was made, for the debug log: the backward node running then
    // (backward_node_running, "" outside one), and whether in backward.
    const char* node;
    bool in_backward;
  };
  static std::string where_made(const Traced& t);  // "in LinearBackward's backward"...
  std::shared_ptr<Allocator> upstream_;
  mutable std::mutex mu_;
  Phase phase_ = Phase::Tracing;                      // GUARDED_BY(mu_)
  uint64_t trace_bytes_;
  std::unique_ptr<TraceAddresses> addresses_;         // GUARDED_BY(mu_), made at the first allocation
  uint64_t events_ = 0;                               // GUARDED_BY(mu_)
  std::vector<Traced> trace_;                         // GUARDED_BY(mu_)
  std::unordered_map<void*, size_t> traced_live_;     // GUARDED_BY(mu_), address → trace_
  void* arena_ = nullptr;                             // GUARDED_BY(mu_)
  uint64_t arena_bytes_ = 0, peak_live_ = 0;          // GUARDED_BY(mu_)
  std::vector<uint64_t> offsets_;                     // GUARDED_BY(mu_), by trace_ index
  size_t next_ = 0;                                   // GUARDED_BY(mu_), the capture's next allocation
  std::unordered_map<void*, size_t> arena_live_;      // GUARDED_BY(mu_), place → trace_
  uint64_t arena_in_use_ = 0;                         // GUARDED_BY(mu_)
  AllocatorStats stats_;                              // GUARDED_BY(mu_)
};

// One training step run as a CUDA graph. `step` queues one step's work on
// the thread's compute stream for `device` (see above for what it may
// read). The first run() traces the step (a capture thrown away: its
// kernels never run), then `after_trace` drops what the traced step left
// that the next step does not read (its gradients, which a step zeroes
// first, and its loss: tensors with no memory behind them, which nothing
// may keep), lays the step's memory out, captures the step and launches
// the graph; every later run() launches it again. On the CPU, or once
// tracing or capture failed (the step's memory did not fit, the step
// waited for the host or allocated other than its trace did), run()
// returns false without running the step, and why_not() says why: the
// caller runs it op by op (a failed trace or capture changed nothing a
// step reads, so running the step again is right). A step's results are
// the same bits either way. Throws std::logic_error where a tensor of the
// trace outlives `after_trace`.
class StepGraph {
 public:
  StepGraph(Device device, std::function<void()> step, std::function<void()> after_trace = {});
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  bool run();
  // Whether run() now launches the graph.
  bool replaying() const { return exec_ != nullptr; }
  // Why run() runs the step op by op ("" while it may still capture).
  const std::string& why_not() const { return why_not_; }
  // Whether that is because the step's memory did not fit (its trace's
  // addresses, or its arena): a graph of a step that needs less may.
  bool ran_out_of_memory() const { return out_of_memory_; }
  int64_t launches() const { return launches_; }
  // Device bytes the graph's memory pool holds.
  uint64_t pool_bytes() const { return pool_ ? pool_->held_bytes() : 0; }
  // Tensors in that memory alive now.
  size_t pool_tensors() const { return pool_ ? pool_->live_allocations() : 0; }
  // Which they are (GraphPool::describe_live).
  std::string describe_pool_tensors() const { return pool_ ? pool_->describe_live() : ""; }

 private:
  // Traces the step, then captures it; false (why_not_ set) on failure,
  // with nothing launched and nothing of the step's state changed on the
  // device.
  bool trace();
  bool capture();
  // Captures the step into `graph` (which the caller destroys), with memory
  // from the pool; "" or why it failed.
  std::string captured(void** graph);
  void launch();

  Device device_;
  std::function<void()> step_, after_trace_;
  std::shared_ptr<GraphPool> pool_;
  void* exec_ = nullptr;  // cudaGraphExec_t
  std::string why_not_;
  bool out_of_memory_ = false;
  double trace_ms_ = 0;
  int64_t launches_ = 0;
};

}  // namespace leasehold::engine
