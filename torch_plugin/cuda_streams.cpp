#include "torch_plugin/cuda_streams.h"

namespace leasehold::torch_plugin {
namespace {

#define LH_CUDA_CHECK(call)                                          \
  do {                                                               \
    cudaError_t lh_err_ = (call);                                    \
    if (lh_err_ != cudaSuccess) throw CudaCallError(lh_err_, #call); \
  } while (0)

// Makes `device` current for the guard's life, when it is not already.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    LH_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) {
      LH_CUDA_CHECK(cudaSetDevice(device));
      changed_ = true;
    }
  }
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// The legacy default stream (0) and the special handles mean "the current
// device's": calls on them need the job's device current.
bool device_relative(StreamId s) {
  return s == 0 || s == reinterpret_cast<StreamId>(cudaStreamLegacy) ||
         s == reinterpret_cast<StreamId>(cudaStreamPerThread);
}

}  // namespace

bool runtime_gone(const std::exception& e) {
  auto* c = dynamic_cast<const CudaCallError*>(&e);
  return c && (c->error() == cudaErrorCudartUnloading || c->error() == cudaErrorContextIsDestroyed);
}

EventId CudaStreams::record(StreamId stream) {
  DeviceGuard guard(device_);
  cudaEvent_t e = take();
  cudaError_t err = cudaEventRecord(e, reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    (void)cudaEventDestroy(e);
    throw CudaCallError(err, "cudaEventRecord");
  }
  return reinterpret_cast<EventId>(e);
}

bool CudaStreams::query(EventId event) {
  cudaError_t err = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError();  // not an error: leave nothing behind for PyTorch's checks
    return false;
  }
  throw CudaCallError(err, "cudaEventQuery");
}

void CudaStreams::wait(EventId event) {
  LH_CUDA_CHECK(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)));
}

void CudaStreams::destroy(EventId event) noexcept {
  auto e = reinterpret_cast<cudaEvent_t>(event);
  std::lock_guard lk(mu_);
  if (spare_.size() < kMaxSpare) {
    spare_.push_back(e);
  } else {
    (void)cudaEventDestroy(e);
  }
}

bool CudaStreams::capturing(StreamId stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaError_t err;
  if (device_relative(stream)) {
    DeviceGuard guard(device_);
    err = cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &status);
  } else {
    err = cudaStreamIsCapturing(reinterpret_cast<cudaStream_t>(stream), &status);
  }
  if (err == cudaErrorStreamCaptureImplicit) {
    // The legacy stream while another stream captures: treat as captured.
    (void)cudaGetLastError();
    return true;
  }
  if (err != cudaSuccess) throw CudaCallError(err, "cudaStreamIsCapturing");
  return status != cudaStreamCaptureStatusNone;  // active, or invalidated but not ended
}

cudaEvent_t CudaStreams::take() {
  {
    std::lock_guard lk(mu_);
    if (!spare_.empty()) {
      cudaEvent_t e = spare_.back();
      spare_.pop_back();
      return e;
    }
  }
  cudaEvent_t e;
  LH_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  return e;
}

}  // namespace leasehold::torch_plugin
