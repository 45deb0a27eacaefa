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
// (GraphPool), which never hands its memory to anything else, so the
// addresses baked into the graph stay valid and unshared as long as it
// lives; tensors the step leaves behind (gradients, the loss) stay in the
// pool and are rewritten by each launch. The pool holds as much as one
// step at its peak, as long as the graph lives.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "agent/engine/allocator.h"

namespace leasehold::engine {

// Memory that a graph's step allocates: blocks taken from `upstream` and
// kept, reused by later allocations of the same size, returned upstream
// when the pool goes (when no tensor it made is alive any more). While
// `capturing` it takes no new block from an upstream that allocates on the
// stream being captured: it hands out the smallest larger free block, or
// throws std::runtime_error when there is none.
class GraphPool final : public Allocator {
 public:
  explicit GraphPool(std::shared_ptr<Allocator> upstream);
  ~GraphPool() override;
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) noexcept override;
  Device device() const override { return upstream_->device(); }
  // in_use: handed out now; cached: held free; allocations: calls so far.
  AllocatorStats stats() const override;
  void set_capturing(bool capturing);
  // Bytes taken from upstream (what the graph holds).
  uint64_t held_bytes() const;

 private:
  std::shared_ptr<Allocator> upstream_;
  mutable std::mutex mu_;
  std::map<size_t, std::vector<void*>> free_;    // GUARDED_BY(mu_), by size
  std::vector<std::pair<void*, size_t>> blocks_;  // GUARDED_BY(mu_), all taken
  std::unordered_map<void*, size_t> size_of_;     // GUARDED_BY(mu_), each block's size
  AllocatorStats stats_;                          // GUARDED_BY(mu_)
  bool capturing_ = false;                        // GUARDED_BY(mu_)
};

// One training step run as a CUDA graph. `step` queues one step's work on
// the thread's compute stream for `device` (see above for what it may
// read). The first run() records: the step runs op by op with memory from
// the graph's pool, so that the pool then holds every block the step
// needs. The second captures the step and launches the graph, and every
// later run() launches it again. On the CPU, or once recording or capture
// failed (the pool outgrew the budget, the step waited for the host or
// needed memory its recording did not), run() returns false without
// running the step, and why_not() says why: the caller runs it op by op
// (a failed recording or capture changed nothing a step reads, so running
// the step again is right). A step's results are the same bits either way.
class StepGraph {
 public:
  StepGraph(Device device, std::function<void()> step);
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  bool run();
  // Whether run() now launches the graph.
  bool replaying() const { return exec_ != nullptr; }
  // Why run() runs the step op by op ("" while it may still capture).
  const std::string& why_not() const { return why_not_; }
  int64_t launches() const { return launches_; }
  // Device bytes the graph's memory pool holds.
  uint64_t pool_bytes() const { return pool_ ? pool_->held_bytes() : 0; }

 private:
  // Captures the step and launches it; false (why_not_ set) on failure,
  // with nothing launched and nothing of the step's state changed on the
  // device.
  bool capture();
  void launch();

  Device device_;
  std::function<void()> step_;
  std::shared_ptr<GraphPool> pool_;
  bool recorded_ = false;
  void* exec_ = nullptr;  // cudaGraphExec_t
  std::string why_not_;
  int64_t launches_ = 0;
};

}  // namespace leasehold::engine
