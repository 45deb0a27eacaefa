// Planned moves of the inputs that recomputed segments keep (recompute.h)
// to page-locked host memory during forward, and back before their
// backward: the bytes a job over its memory budget cannot keep on the
// device and has no compute left to trade for (every block recomputes
// already), moved without waiting, overlapped with the step's kernels.
// This is what PyTorch's save_on_cpu does for every saved tensor, done for
// the few large ones a schedule names, so that the copies fit the link:
// a GPT block's kept input (24 MiB) crosses a PCIe 5 link in about half a
// millisecond, about two and a half blocks' forward.
//
// The schedule: a segment's input is copied out on the device's copy
// stream (cuda_context.h) as the segment starts; its device memory goes
// once forward went on past kOffloadReleaseAfterBlocks blocks
// (offload_progress(), which the blocks call as each forward ends), the
// compute stream waiting for the copy there. The copies out run one after
// another, and a GPT block's input takes about two and a half blocks'
// forward to cross (a block run without keeping anything: 0.21 ms on an
// H200, its input 0.5 ms). At 25% of the GPT job's peak: let go after two
// blocks, forward waited for each copy in turn (60.7% of unconstrained
// speed); after three, 65%; after four, 71.5-73.2%, once a recomputed
// MLP's input gradient stopped needing a buffer of its own (recompute.cpp)
// and the inputs still on the device at the last block's backward fit.
// In backward, each recomputed segment fetches the input the next one in
// backward order needs (the latest stashed that backward has not read)
// once it has run again, while its own backward runs, so one input at a
// time comes back ahead of its use; one still on the device (forward
// ended too soon after it) is read there, and older ones still there are
// let go then. The compute stream waits for a copy only by events, never
// the host: a step with offloads can be captured as a CUDA graph
// (step_graph.h), whose trace makes the same allocations and
// frees in the same order.
//
// Host memory belongs to an OffloadSlot, one per kept tensor of a module
// (a transformer block's input), reused step after step at the same
// address (a graph's copies are baked in). It grows only, for a tensor
// larger than any before it, which a graph of fixed shapes never meets
// once captured (its step's tensors were the largest). A slot holds one tensor at a
// time: when its memory still holds one that a live backward graph needs
// (a second forward before the first's backward), the new tensor stays on
// the device instead; nothing is overwritten.
//
// On the CPU the same calls copy at once (host memory is where the tensor
// was) and let the tensor's memory go on the same schedule: the
// bookkeeping is the same, which is what CPU tests check.
//
// Thread safety: a slot and its handles on one thread (the job's), which
// runs forward and backward.
#pragma once

#include <cstdint>
#include <memory>

#include "agent/engine/tensor.h"

namespace leasehold::engine {

class OffloadedTensor;

// Blocks forward goes past after a stash before its device copy is let go
// (see the top).
inline constexpr uint64_t kOffloadReleaseAfterBlocks = 4;

class OffloadSlot {
 public:
  OffloadSlot();
  ~OffloadSlot();
  OffloadSlot(const OffloadSlot&) = delete;
  OffloadSlot& operator=(const OffloadSlot&) = delete;

  // Starts moving `x` to the slot's host memory (see the top) and returns
  // what backward gets it back from. `x` stays on the device instead, held
  // by the handle, when the slot's memory is still claimed by another
  // handle, `x` is not contiguous, or page-locked memory for it cannot be
  // had (logged once per slot).
  std::shared_ptr<OffloadedTensor> stash(const Tensor& x);
  // Page-locked bytes the slot holds (its largest tensor so far).
  uint64_t host_bytes() const;
  // Whether host memory for a tensor could not be had, at least once (the
  // tensor stayed on the device; logged then).
  bool short_of_memory() const;

  struct State;

 private:
  std::shared_ptr<State> state_;
};

class OffloadedTensor {
 public:
  // The tensor on its device again: the same values, in the memory it had
  // if that is still held, else in new memory (fetched ahead of this call
  // where the schedule could: offload_prefetch_next). Again after backward
  // with retain_graph: copied in again.
  Tensor get();
  // Whether the tensor left the device (false: the slot was claimed, or
  // the tensor was not contiguous, and it stayed).
  bool offloaded() const { return offloaded_; }
  ~OffloadedTensor();
  OffloadedTensor(const OffloadedTensor&) = delete;
  OffloadedTensor& operator=(const OffloadedTensor&) = delete;

 private:
  friend class OffloadSlot;
  friend void offload_progress();
  friend void offload_prefetch_next();
  enum class Where {
    Kept,        // on the device only (never moved)
    CopyingOut,  // copy out queued; the device memory still held
    OnHost,      // on the host only
    CopyingIn,   // copy in queued into new device memory
    HandedOut,   // on the host, and get() handed the device copy out
  };
  OffloadedTensor() = default;
  // Queues the copy in to new device memory (OnHost or HandedOut).
  void fetch();
  // Lets the device copy go once the compute stream is past its copy.
  void release_device_copy();
  // The same for a tensor copying out, which is then on the host only.
  void let_device_copy_go();

  std::shared_ptr<OffloadSlot::State> slot_;
  Shape sizes_;
  TensorOptions options_;
  uint64_t bytes_ = 0;
  Tensor device_;  // Kept, CopyingOut, CopyingIn
  Where where_ = Where::Kept;
  bool offloaded_ = false;
  bool read_in_place_ = false;  // get() handed out the device copy (CopyingOut)
  uint64_t stashed_at_ = 0;  // the thread's offload_progress() count then
  void* stream_ = nullptr;   // the compute stream it was stashed from (cudaStream_t)
};

// Forward went past a block: device copies of inputs stashed
// kOffloadReleaseAfterBlocks blocks ago (or earlier) are let go, once the
// compute stream waits for their copies out (which by then are usually
// done).
void offload_progress();
// A recomputed segment has run again and its backward is about to run: the
// latest input stashed on this thread that backward has not read is
// fetched if it is only on the host, unless one is on its way in already
// (one ahead at a time), and stays where it is if it is still on the
// device; any older one still on the device is let go.
void offload_prefetch_next();

}  // namespace leasehold::engine
