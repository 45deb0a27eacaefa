// Batches of a dataset held in host memory, for a CUDA device, without the
// training thread ever waiting for the device. A loader thread gathers the
// next batches (in the epoch's order) into pinned host buffers allocated
// once; next() takes a filled one and queues its copy to freshly allocated
// device tensors with cudaMemcpyAsync, then records an event. A buffer is
// refilled only after its event completed, and the loader thread is the one
// that waits for it.
//
// The copies go on the compute stream, in order with the step's kernels:
// the job's caching allocator hands out memory in that stream's order, so a
// copy on a stream of its own could write into a block whose previous
// kernels have not run yet. What matters for sharing (no host wait in a
// step) holds either way, and a batch is a few hundred KiB.
//
// Thread safety: one training thread calls start_epoch() and next().
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "agent/engine/tensor.h"

namespace leasehold::engine::data {

struct Dataset;

class HostBatches {
 public:
  // `data` in host memory (float32 images, int64 labels) outlives this.
  // Allocates `slots` pinned buffers of `batch` rows (pinning memory waits
  // for the device: once per iterator, here).
  HostBatches(const Dataset& data, int64_t batch, Device device, int slots = 3);
  // Stops the loader; waits for copies still reading the pinned buffers.
  ~HostBatches();
  HostBatches(const HostBatches&) = delete;
  HostBatches& operator=(const HostBatches&) = delete;

  // Batches from now on follow `order` (indices into the dataset).
  void start_epoch(const std::vector<int64_t>& order);
  // The next batch of the epoch on the device; false at its end. Waits only
  // for the loader thread's host work.
  bool next(Tensor& images, Tensor& labels);

 private:
  struct Slot;
  void load_loop();     // the loader thread: load_batches(), errors kept in error_
  void load_batches();
  void release_slots();  // waits for copies in flight, frees the buffers

  const Dataset& data_;
  const int64_t batch_;
  const int64_t row_floats_;
  const Device device_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<int64_t> order_;  // GUARDED_BY(mu_)
  uint64_t epoch_ = 0;          // generation of order_; GUARDED_BY(mu_)
  int64_t loaded_ = 0;          // batches of this epoch handed to slots; GUARDED_BY(mu_)
  int64_t taken_ = 0;           // batches of this epoch given out by next(); GUARDED_BY(mu_)
  bool stop_ = false;           // GUARDED_BY(mu_)
  std::exception_ptr error_;    // the loader's failure; GUARDED_BY(mu_)
  std::thread loader_;
};

}  // namespace leasehold::engine::data
