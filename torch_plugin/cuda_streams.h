// CUDA streams and events as the block cache's StreamOps (block_cache.h),
// and the error every CUDA call of the plug-in reports through.
//
// Thread safety: every method may be called from any thread. Calls on the
// streams that mean "the current device's" (0, cudaStreamLegacy,
// cudaStreamPerThread) make the job's device current for the call only, so
// the calling thread's device is never changed for longer than that.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "torch_plugin/block_cache.h"

namespace leasehold::torch_plugin {

// A failed CUDA call: "leasehold: <call> failed: <error name> (<text>)".
class CudaCallError : public std::runtime_error {
 public:
  CudaCallError(cudaError_t err, const char* call)
      : std::runtime_error(std::string("leasehold: ") + call + " failed: " + cudaGetErrorName(err) +
                           " (" + cudaGetErrorString(err) + ")"),
        err_(err) {}
  cudaError_t error() const { return err_; }

 private:
  cudaError_t err_;
};

// At process exit the CUDA runtime may be gone before PyTorch frees its last
// tensors; nothing is left to do for them. Whether `e` says so.
bool runtime_gone(const std::exception& e);

// Streams and events of the job's device. Events are kept for reuse
// (creating one costs more than recording it). Failures throw
// CudaCallError, except where StreamOps says a method never throws.
class CudaStreams final : public StreamOps {
 public:
  explicit CudaStreams(int device) : device_(device) {}

  EventId record(StreamId stream) override;
  bool query(EventId event) override;
  void wait(EventId event) override;
  void destroy(EventId event) noexcept override;
  bool capturing(StreamId stream) override;

 private:
  static constexpr size_t kMaxSpare = 1024;  // events kept for reuse, at most
  // A spare event, or a new one.
  cudaEvent_t take();

  const int device_;
  std::mutex mu_;
  std::vector<cudaEvent_t> spare_;  // GUARDED_BY(mu_)
};

}  // namespace leasehold::torch_plugin
