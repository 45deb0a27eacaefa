#include "agent/engine/cuda_context.h"

#include "agent/engine/kernel_table.h"

#include <atomic>
#include <stdexcept>
#include <string>

#ifdef LEASEHOLD_HAVE_CUDA
#include "kernels/fault.h"
#include "kernels/matmul.h"
#include "shared/cuda_check.h"
#endif

namespace leasehold::engine {
namespace {
std::atomic<bool> g_tf32{false};
std::atomic<uint64_t> g_host_waits{0};
thread_local bool t_tracing_step = false;
}  // namespace

bool tracing_step() { return t_tracing_step; }
TracingStepGuard::TracingStepGuard() : previous_(t_tracing_step) { t_tracing_step = true; }
TracingStepGuard::~TracingStepGuard() { t_tracing_step = previous_; }

uint64_t host_waits() { return g_host_waits.load(std::memory_order_relaxed); }
void note_host_wait() { g_host_waits.fetch_add(1, std::memory_order_relaxed); }

void set_allow_tf32(bool allow) { g_tf32.store(allow); }

void fence_device(Device device) {
  if (!device.is_cuda()) return;
#ifdef LEASEHOLD_HAVE_CUDA
  LEASEHOLD_CUDA_CHECK(cudaSetDevice(device.index));
  note_host_wait();
  LEASEHOLD_CUDA_CHECK(cudaDeviceSynchronize());
#else
  throw std::logic_error("fence_device: a CUDA device in a build without CUDA");
#endif
}
bool allow_tf32() { return g_tf32.load(); }

std::optional<std::string> device_context_lost(Device device) {
  if (!device.is_cuda()) return std::nullopt;
#ifdef LEASEHOLD_HAVE_CUDA
  // An ordinary error is returned once and cleared; a sticky one is
  // returned by every call, so two in a row mean the context is gone.
  (void)cudaGetLastError();  // an ordinary error left behind is not the question
  cudaError_t first = cudaSetDevice(device.index);
  if (first == cudaSuccess) first = cudaDeviceSynchronize();
  if (first == cudaSuccess) return std::nullopt;
  (void)cudaGetLastError();
  cudaError_t again = cudaDeviceSynchronize();
  if (again == cudaSuccess) return std::nullopt;
  return std::string(cudaGetErrorName(again)) + " (" + cudaGetErrorString(again) + ")";
#else
  return std::nullopt;
#endif
}

void inject_device_fault(Device device) {
  if (!device.is_cuda()) throw std::logic_error("inject_device_fault: not a CUDA device");
#ifdef LEASEHOLD_HAVE_CUDA
  kernels::cuda::write_to_unmapped_address(compute_stream(device.index));
#endif
}

void set_measured_gemm_choice([[maybe_unused]] bool on) {
#ifdef LEASEHOLD_HAVE_CUDA
  kernels::cuda::set_gemm_measured_choice(on);
#endif
}

kernels::Stream stream_for([[maybe_unused]] Device d) {
#ifdef LEASEHOLD_HAVE_CUDA
  if (d.is_cuda()) return compute_stream(d.index);
#endif
  return nullptr;
}

#ifdef LEASEHOLD_HAVE_CUDA
namespace {
constexpr int kMaxDevices = 64;

struct ThreadState {
  cudaStream_t streams[kMaxDevices] = {};
  cudaStream_t copy_streams[kMaxDevices] = {};
  cublasHandle_t handles[kMaxDevices] = {};
  cublasLtHandle_t lt_handles[kMaxDevices] = {};
  ~ThreadState() {
    // Tolerates the runtime unloading at exit: errors are ignored.
    for (int d = 0; d < kMaxDevices; ++d) {
      if (lt_handles[d]) cublasLtDestroy(lt_handles[d]);
      if (handles[d]) cublasDestroy(handles[d]);
      if (streams[d]) cudaStreamDestroy(streams[d]);
      if (copy_streams[d]) cudaStreamDestroy(copy_streams[d]);
    }
  }
};
thread_local ThreadState t_state;

void check_device(int device) {
  if (device < 0 || device >= kMaxDevices) {
    throw std::invalid_argument("CUDA device index " + std::to_string(device) + " out of range");
  }
}
}  // namespace

cudaStream_t existing_compute_stream(int device) noexcept {
  return device >= 0 && device < kMaxDevices ? t_state.streams[device] : nullptr;
}

namespace {
// The stream of `streams` for `device`, made on first use (non-blocking).
cudaStream_t stream_of(cudaStream_t (&streams)[kMaxDevices], int device) {
  check_device(device);
  cudaStream_t& s = streams[device];
  if (!s) {
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
    LEASEHOLD_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  }
  return s;
}
}  // namespace

cudaStream_t compute_stream(int device) { return stream_of(t_state.streams, device); }

cudaStream_t copy_stream(int device) { return stream_of(t_state.copy_streams, device); }

// Creates a cuBLAS or cuBLASLt handle on `device` into `h`; throws naming
// `what` and the device when the library cannot make one.
template <class Handle>
void create_handle(Handle& h, int device, cublasStatus_t (*create)(Handle*), const char* what) {
  LEASEHOLD_CUDA_CHECK(cudaSetDevice(device));
  if (const cublasStatus_t st = create(&h); st != CUBLAS_STATUS_SUCCESS) {
    h = nullptr;
    throw std::runtime_error(std::string(what) + " failed on device " + std::to_string(device) +
                             ": " + cublasGetStatusString(st));
  }
}

cublasHandle_t cublas_handle(int device) {
  check_device(device);
  cublasHandle_t& h = t_state.handles[device];
  if (!h) {
    create_handle(h, device, &cublasCreate, "cublasCreate");
    if (cublasSetStream(h, compute_stream(device)) != CUBLAS_STATUS_SUCCESS) {
      cublasDestroy(h);
      h = nullptr;
      throw std::runtime_error("cublasSetStream failed on device " + std::to_string(device));
    }
  }
  return h;
}

cublasLtHandle_t cublaslt_handle(int device) {
  check_device(device);
  cublasLtHandle_t& h = t_state.lt_handles[device];
  if (!h) create_handle(h, device, &cublasLtCreate, "cublasLtCreate");
  return h;
}

void synchronize(int device) {
  note_host_wait();
  LEASEHOLD_CUDA_CHECK(cudaStreamSynchronize(compute_stream(device)));
}
#endif

}  // namespace leasehold::engine
