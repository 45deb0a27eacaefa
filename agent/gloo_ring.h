// A sum all-reduce of float32 over a Gloo context that another thread can
// abort at any moment. A replica stops (a cancel, a requeue) while its
// all-reduce may be waiting for a peer that stopped at a step boundary and
// will never join. gloo::allreduce cannot be stopped there: it waits on a
// scratch buffer it keeps to itself, and closing the context's connections
// takes the sockets off Gloo's event loop, so nothing wakes the wait until
// the collective timeout (minutes). This ring owns both of its buffers, so
// abort() ends whichever wait is running, and every later one.
//
// The ring: each rank's data is split into one chunk per rank; in
// world_size - 1 steps every rank sends a chunk to the next rank and adds
// the previous rank's into its own (reduce-scatter), then in world_size - 1
// more steps passes the finished chunks on (all-gather). Each chunk's sum is
// formed in one fixed order and copied to every rank, so every rank ends
// with the same bits.
#pragma once

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>

#include <chrono>
#include <cstddef>
#include <memory>
#include <mutex>
#include <vector>

namespace leasehold {

class GlooRing {
 public:
  // `timeout`: the longest one step may wait for a peer.
  GlooRing(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout);
  GlooRing(const GlooRing&) = delete;
  GlooRing& operator=(const GlooRing&) = delete;

  // Sums `n` floats at `data` over every rank, in place. Returns false when
  // abort() ended it (`data` is then partly reduced, and the context is no
  // use for further collectives). Throws gloo::IoException when a peer
  // does not answer within the timeout or its connection broke.
  bool allreduce(float* data, size_t n);

  // Thread-safe: ends the running all-reduce's wait, and makes every later
  // all-reduce return false at once.
  void abort();

 private:
  using Buffer = gloo::transport::UnboundBuffer;
  // Waits for one receive (`recv`) or one send on `buf`; false when aborted.
  bool wait(Buffer& buf, bool recv);

  const std::shared_ptr<gloo::Context> context_;
  const std::chrono::milliseconds timeout_;
  std::vector<float> scratch_;  // one chunk from the previous rank (outlives scratch_buf_)

  std::mutex mu_;  // guards what abort() touches
  bool aborted_ = false;
  std::unique_ptr<Buffer> scratch_buf_;
  Buffer* data_buf_ = nullptr;  // the running all-reduce's
};

}  // namespace leasehold
