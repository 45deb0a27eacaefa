// The spill store: where a job's cold tensors go when its device memory
// budget cannot hold them (FlashNeuron's offload, SSDTrain's tiered
// activations). An interface in the spirit of LevelDB's Env: results are
// Status values and no exception crosses it, so a full disk or a bad read
// fails the job with a clear reason and never the agent.
//
// Implementations:
//   - TieredSpillStore (tiered_store.h): pinned host memory, then a spill
//     file (O_DIRECT, checksummed chunks, a thread pool doing the I/O);
//   - MemorySpillStore (memory_store.h): plain heap memory, for tests and
//     for budgets where only correctness matters;
//   - FaultInjectingSpillStore (fault_store.h): wraps another store and fails
//     chosen calls (ENOSPC at the k-th put, EIO on a get, a corrupted chunk).
//
// Device memory: `src` and `dst` are the job's tensor memory, on the device
// of the store's Transfer (transfer.h): host memory on the host backend,
// CUDA device memory on the CUDA backend. Copies run on the Transfer's copy
// stream, ordered after the work the calling thread queued on its compute
// stream, so the caller never waits for a copy it does not need yet.
//
// The caller (engine::SpillManager) tells the store the order in which
// tensors will come back; the store does not guess.
//
// Thread safety: one thread (the job's) calls the methods; implementations
// run their own I/O threads internally.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "agent/engine/allocator.h"
#include "shared/status.h"

namespace leasehold::spill {

class Fence;  // transfer.h

using SpillId = uint64_t;

struct SpillStats {
  // Tensor bytes as put (each tier rounds a tensor up to 4 KiB internally).
  uint64_t host_bytes = 0;         // held in the host tier now
  uint64_t file_bytes = 0;         // held in the spill file now
  uint64_t peak_host_bytes = 0;
  uint64_t peak_file_bytes = 0;
  uint64_t bytes_out = 0;          // copied off the device so far (puts)
  uint64_t bytes_in = 0;           // copied back to the device so far (gets)
  uint64_t file_bytes_written = 0;  // including the padding of each chunk to 4 KiB
  uint64_t file_bytes_read = 0;
  uint64_t staging_hits = 0;       // chunks a get took from a staging buffer (write in flight)
  // Seconds the copy engine and the disk were busy, for achieved bandwidth
  // (bytes / seconds). Overlapping transfers count once.
  double copy_busy_seconds = 0;
  double file_busy_seconds = 0;
};

class SpillStore {
 public:
  virtual ~SpillStore() = default;

  // Starts copying `bytes` at `src` off the device under the new key `id`.
  // `name` names the tensor in errors. `src` must stay allocated and
  // unchanged until copied(id) is true (or wait_copied(id) returned).
  // Errors: I/O error with ENOSPC when no tier has room, or another I/O
  // error; nothing is stored under `id` then.
  virtual Status put(SpillId id, const void* src, size_t bytes, const std::string& name) = 0;

  // Whether the device bytes of `id` have been read completely, so `src`
  // may be freed and reused. Never blocks.
  virtual bool copied(SpillId id) = 0;
  // Blocks until copied(id). An error of the copy (a failed file write)
  // may be reported here or by the next get(id).
  virtual Status wait_copied(SpillId id) = 0;

  // A hint: `id` will be needed soon, start bringing it closer (file →
  // host). Never blocks for long; errors surface at get().
  virtual void prefetch(SpillId id) = 0;

  // Copies the bytes of `id` into `dst` (device memory of at least the
  // put's size). Work the calling thread queues on its compute stream after
  // this returns sees the bytes. Errors: corruption (a checksum mismatch,
  // naming the tensor and the file), I/O error, not found.
  virtual Status get(SpillId id, void* dst) = 0;

  // The same copy, for a prefetch: the compute stream is not ordered after
  // it; `*done` is set to a fence after the copy, which the caller makes
  // the compute stream wait for (Transfer::compute_waits) before using the
  // bytes. Null `*done`: the bytes are already visible as after get().
  // The default is get() itself.
  virtual Status get_async(SpillId id, void* dst, std::shared_ptr<Fence>* done) {
    *done = nullptr;
    return get(id, dst);
  }

  // Forgets `id` and frees what it held. Unknown ids are ignored.
  virtual void erase(SpillId id) = 0;

  virtual SpillStats stats() const = 0;

  // Page-locked host memory for tensors the job keeps in host memory by
  // plan (engine/host_offload.h, engine/optim.h), counted in the same host
  // tier as its spills and refused past its room (host_tier.h); null where
  // the store has no host tier (the job then keeps no such tensors). Its
  // memory must be freed before the store is destroyed (the job's tensors
  // go before its spill manager).
  virtual std::shared_ptr<engine::Allocator> host_allocator() { return nullptr; }
};

}  // namespace leasehold::spill
