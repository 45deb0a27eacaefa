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
// (GraphPool). The step's recording, op by op, traces its allocations and
// frees; the capture then gives each allocation its place in one arena laid
// out from that trace (memory_plan.h), which never serves anything else, so
// the addresses baked into the graph stay valid and unshared as long as it
// lives. Tensors the step leaves behind (gradients, the loss) stay in the
// arena and are rewritten by each launch. The arena holds about as much as
// the step has live at once at its peak (memory_plan.h; for the GPT job
// exactly that), so a step that fits its budget op by op usually fits it
// as a graph; one that does not is run op by op (graphed_steps.h says what
// a job then does).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "agent/engine/allocator.h"

namespace leasehold::engine {

// Memory that a graph's step allocates, in three phases:
//   - recording: each allocation is taken from `upstream` and freed back to
//     it as usual, and traced (its size, when it was made and freed);
//   - plan(): lays the traced allocations out in one arena taken from
//     `upstream` (memory_plan.h); it throws OutOfMemoryError where the
//     upstream cannot give it. What the recording left live should be freed
//     first (its memory can then be the arena's);
//   - capturing: the step runs again and makes the same allocations in the
//     same order; each gets its planned place. One that differs from the
//     recording's, or that comes while a tensor the recording had freed by
//     then is still alive (the two may share bytes), throws
//     std::runtime_error, and capture_mismatch() names a capture that made
//     fewer (the capture is abandoned). Nothing is taken from `upstream`
//     then. Memory of the recording freed during or after the capture may
//     be read by the graph: it stays the pool's until the pool goes.
// The arena returns upstream when the pool goes (when no tensor it made is
// alive any more). After the capture it serves no more allocations.
// Upstream is called without the pool's lock held.
class GraphPool final : public Allocator {
 public:
  explicit GraphPool(std::shared_ptr<Allocator> upstream);
  ~GraphPool() override;
  void* allocate(size_t bytes) override;
  void deallocate(void* ptr, size_t bytes) noexcept override;
  Device device() const override { return upstream_->device(); }
  // in_use: handed out now; cached: the arena's rest; allocations: calls so far.
  AllocatorStats stats() const override;
  void plan();
  void set_capturing(bool capturing);
  // "" when the capture made every allocation its recording did; else why not.
  std::string capture_mismatch() const;
  // Bytes taken from upstream: the recording's live allocations, then the arena.
  uint64_t held_bytes() const;
  // The most bytes the recorded step had live at once (0 before plan()).
  uint64_t peak_live_bytes() const;
  // Tensors it made that are alive now.
  size_t live_allocations() const;

 private:
  enum class Phase { Recording, Planned, Capturing, Captured };
  void* place_captured(size_t bytes);  // REQUIRES: mu_ held
  struct Traced {
    size_t bytes;
    uint64_t first, last;  // events; last = UINT64_MAX while live
  };
  std::shared_ptr<Allocator> upstream_;
  mutable std::mutex mu_;
  Phase phase_ = Phase::Recording;                    // GUARDED_BY(mu_)
  uint64_t events_ = 0;                               // GUARDED_BY(mu_)
  std::vector<Traced> trace_;                         // GUARDED_BY(mu_)
  std::unordered_map<void*, size_t> recorded_live_;   // GUARDED_BY(mu_), upstream block → trace_
  std::vector<std::pair<void*, size_t>> kept_;        // GUARDED_BY(mu_), freed once captured
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
// read). The first run() records: the step runs op by op with memory from
// the graph's pool, which traces what it needs. The second lays that out
// (after `before_capture`, which may drop what the recorded step left and
// the next step does not read: its gradients, which a step zeroes first),
// captures the step and launches the graph, and every later run() launches
// it again. On the CPU, or once recording or capture failed (the step ran
// out of memory, its arena did not fit, the step waited for the host or
// allocated other than its recording did), run() returns false without
// running the step, and why_not() says why: the caller runs it op by op (a
// failed recording or capture changed nothing a step reads, so running the
// step again is right). A step's results are the same bits either way.
class StepGraph {
 public:
  StepGraph(Device device, std::function<void()> step,
            std::function<void()> before_capture = {});
  ~StepGraph();
  StepGraph(const StepGraph&) = delete;
  StepGraph& operator=(const StepGraph&) = delete;

  bool run();
  // Whether run() now launches the graph.
  bool replaying() const { return exec_ != nullptr; }
  // Why run() runs the step op by op ("" while it may still capture).
  const std::string& why_not() const { return why_not_; }
  // Whether that is because the step's memory did not fit (recording it,
  // or laying it out): a graph of a step that needs less may.
  bool ran_out_of_memory() const { return out_of_memory_; }
  int64_t launches() const { return launches_; }
  // Device bytes the graph's memory pool holds.
  uint64_t pool_bytes() const { return pool_ ? pool_->held_bytes() : 0; }
  // Tensors in that memory alive now.
  size_t pool_tensors() const { return pool_ ? pool_->live_allocations() : 0; }

 private:
  // Captures the step and launches it; false (why_not_ set) on failure,
  // with nothing launched and nothing of the step's state changed on the
  // device.
  bool capture();
  void launch();

  Device device_;
  std::function<void()> step_, before_capture_;
  std::shared_ptr<GraphPool> pool_;
  bool recorded_ = false;
  void* exec_ = nullptr;  // cudaGraphExec_t
  std::string why_not_;
  bool out_of_memory_ = false;
  int64_t launches_ = 0;
};

}  // namespace leasehold::engine
