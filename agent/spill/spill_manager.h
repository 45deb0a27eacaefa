// The engine side of spilling: saved-tensor hooks that keep a job's
// activations on the device while they fit its budget and move the coldest
// ones to a SpillStore when they do not (FlashNeuron's offload, with the
// order known instead of guessed).
//
// - pack() registers each saved tensor of at least `min_bytes` whose memory
//   comes from the job's allocator, in save order (one entry per storage,
//   however many views of it are saved); the others stay as they are.
// - reclaim(bytes) is the allocator's reclaimer: when an allocation would
//   exceed the budget it frees entries oldest first (saved earliest in the
//   forward pass, so needed last in backward) until `bytes` are free: first
//   those whose copy is already out, then it starts copies of the next ones
//   and waits for them. Only storages nothing else references are freed
//   (parameters, and activations still in use by the forward pass, stay).
// - Once the budget has been hit, pack() starts copying the oldest tensors
//   out ahead of time whenever the memory in use passes `offload_mark` of
//   the budget, so a later reclaim finds them already copied and frees them
//   without waiting. Tensors saved during backward (a recomputed block's)
//   are not copied ahead: the same backward uses them moments later.
// - unpack() brings an evicted tensor back (from the host tier or the
//   file), and prefetches: the next `lookahead` evicted entries in backward
//   order are copied back into device memory if it is free without
//   spilling and leaves `prefetch_headroom` for the gradients to come, and
//   the `file_lookahead` after them are read from the file into host
//   memory.
// - shrink(bytes) frees memory on request (the occupancy policy's Shrink).
// - end_step() after each training step sizes the copies ahead to the step
//   before: after a step that had to free nothing there are none until the
//   budget is hit again (then they are unlimited until the step ends), and
//   otherwise the bytes copied out and still on the device stay under a
//   quarter more than that step freed, not every byte above the mark (a
//   job whose blocks recompute, or whose budget is just short, would copy
//   out far more than it ever frees, and the copies it needs would queue
//   behind them on the link).
//
// A store error (full disk, I/O error, checksum mismatch) is thrown as
// SpillError naming the tensor; the job fails, the agent does not.
//
// Thread safety: one job thread uses it (the thread whose saved tensors and
// allocations it handles).
#pragma once

#include <any>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "agent/engine/autograd.h"
#include "agent/spill/spill_store.h"
#include "agent/spill/transfer.h"

namespace leasehold::spill {

class SpillError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct SpillPolicy {
  uint64_t min_bytes = 256 << 10;  // smaller saved tensors always stay
  int lookahead = 2;               // evicted entries restored ahead in backward
  // Restore ahead only while the budget keeps this many times the bytes of
  // the tensor being used free beside it (its gradients come next): a
  // restore that takes that room makes another tensor go out and come back.
  // Measured on the spill benchmark at a quarter of the peak (H100): no
  // headroom moved 7.2 GB a step at 440 ms, 1× 4.6 GB at 367 ms, 2× 3.1 GB
  // at 367 ms (fewer bytes matter most for the spill file).
  double prefetch_headroom = 2.0;
  int file_lookahead = 4;          // further entries read from the file ahead
  // Once the budget has been hit, copy ahead above this fraction of it.
  // Measured at a quarter of the peak (H100): 0.8 stepped in 367 ms, 0.6 in
  // 346 ms (copies out finish before a reclaim waits for them), 0.5 in 344.
  double offload_mark = 0.6;
};

struct SpillCounters {
  uint64_t evictions = 0, evicted_bytes = 0;  // device memory freed
  // Of the evictions, tensors saved during backward (a recomputed
  // segment's own activations): the backward's working set was over the
  // budget, not only what the forward pass kept.
  uint64_t working_set_evictions = 0;
  uint64_t restores = 0, restored_bytes = 0;  // brought back to the device
  uint64_t prefetched = 0;                    // of the restores, those done ahead
  uint64_t reclaims = 0;                      // times the allocator asked
};

class SpillManager final : public engine::SavedTensorHooks,
                           public std::enable_shared_from_this<SpillManager> {
 public:
  // Installs the manager as `allocator`'s reclaimer (removed again when the
  // manager is destroyed). The transfer must be the store's.
  static std::shared_ptr<SpillManager> create(std::unique_ptr<SpillStore> store,
                                              std::shared_ptr<Transfer> transfer,
                                              std::shared_ptr<engine::Allocator> allocator,
                                              SpillPolicy policy = {});
  ~SpillManager() override;

  // Tensors whose memory never spills, however often they are saved (the
  // parameters and the optimiser's state: they are needed every step).
  // Their storages must outlive the manager's use of them (the job).
  void keep_resident(const std::vector<engine::Tensor>& tensors);

  std::any pack(const engine::Tensor& t) override;
  engine::Tensor unpack(const std::any& packed) override;

  // Frees at least `bytes` of device memory if it can; returns what it
  // freed. Throws SpillError when the store fails.
  uint64_t reclaim(uint64_t bytes);
  // The same, asked from outside (the occupancy policy's Shrink): the
  // memory goes to the allocator's cache; LeaseAllocator::empty_cache()
  // then gives whole free leases back.
  uint64_t shrink(uint64_t bytes) { return reclaim(bytes); }
  // A training step ended (see the top of the file).
  void end_step();
  // Whether the step end_step() last ended freed saved tensors to stay
  // within the budget (false before the first). A step of the same shapes
  // that did not fits the budget as it is, without the hooks: it may run as
  // a CUDA graph (graphed_steps.h).
  bool last_step_spilled() const { return last_step_spilled_; }
  // The bytes it freed so (0 when it freed none).
  uint64_t last_step_spilled_bytes() const { return last_step_spilled_bytes_; }
  // Whether, in that step, tensors saved during backward had to leave too
  // (SpillCounters::working_set_evictions).
  bool last_step_spilled_working_set() const { return last_step_spilled_working_set_; }
  // Whether the last reclaim that freed less than it was asked ran during
  // backward with tensors saved there (a recomputed segment's) on the
  // device: what a recomputed backward needs at once did not fit.
  bool last_shortfall_in_recomputed_backward() const {
    return last_shortfall_in_recomputed_backward_;
  }

  SpillStats store_stats() const { return store_->stats(); }
  // The store's page-locked host memory for tensors kept there by plan
  // (spill_store.h: host_allocator); null where it has no host tier.
  std::shared_ptr<engine::Allocator> host_allocator() { return store_->host_allocator(); }
  SpillCounters counters() const { return counters_; }
  // Saved tensors registered now, and how many of them are off the device.
  size_t entries() const { return entries_.size(); }
  size_t evicted_entries() const;

 private:
  // Resident: on the device only. Stored: on the device, and a copy is in the
  // store or on its way. Evicted: in the store only. Restoring: a copy back
  // to the device is in flight (restore_fence).
  enum class State { Resident, Stored, Evicted, Restoring };
  struct Entry {
    std::shared_ptr<engine::Storage> storage;  // null while evicted
    size_t bytes = 0;
    std::string name;
    State state = State::Resident;
    bool stored = false;                   // the store holds a copy
    bool file_prefetch_asked = false;
    bool hot = false;                      // saved during backward: never copied ahead
    std::shared_ptr<Fence> restore_fence;  // State::Restoring
    int handles = 0;
  };
  class Handle;

  SpillManager(std::unique_ptr<SpillStore> store, std::shared_ptr<Transfer> transfer,
               std::shared_ptr<engine::Allocator> allocator, SpillPolicy policy);
  bool evictable(const Entry& e) const;
  void start_copy(uint64_t seq, Entry& e);
  void evict(Entry& e);
  void ensure_resident(uint64_t seq, Entry& e);
  // `in_use_bytes`: the size of the tensor backward uses now.
  void prefetch_before(uint64_t seq, uint64_t in_use_bytes);
  void offload_ahead();
  void drop_handle(uint64_t seq) noexcept;
  // Waits for every copy started so far (before freeing memory a failed
  // restore may still be writing).
  void settle_copies() noexcept;
  [[noreturn]] void fail(const Entry& e, const char* what, const Status& st) const;

  std::shared_ptr<Transfer> transfer_;
  std::shared_ptr<engine::Allocator> allocator_;
  std::unique_ptr<SpillStore> store_;  // uses transfer_: destroyed first
  SpillPolicy policy_;
  std::map<uint64_t, Entry> entries_;  // by save order, oldest first
  std::unordered_map<const engine::Storage*, uint64_t> resident_;  // storage → entry
  std::unordered_set<const engine::Storage*> kept_;                 // never spilled
  uint64_t next_seq_ = 1;
  bool pressured_ = false;   // the budget has been hit, and not since left alone a step
  // The most bytes offload_ahead() keeps copied out and still on the
  // device: from what the last step freed (end_step(); no limit before the
  // first, nor once a reclaim follows a step that freed nothing).
  uint64_t ahead_limit_ = UINT64_MAX;
  SpillCounters at_step_start_;
  bool last_step_spilled_ = false, last_step_spilled_working_set_ = false;
  bool last_shortfall_in_recomputed_backward_ = false;
  uint64_t last_step_spilled_bytes_ = 0;
  bool reclaiming_ = false;  // inside reclaim(): do not re-enter
  SpillCounters counters_;
};

}  // namespace leasehold::spill
