// Per-thread CUDA state of the engine: the compute stream every operator
// runs on (never the legacy default stream, so copy streams can overlap
// later), the cuBLAS handle bound to it, and the TF32 switch.
#pragma once

#ifdef LEASEHOLD_HAVE_CUDA
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#endif

#include <optional>
#include <string>

#include "agent/engine/dtype.h"

namespace leasehold::engine {

// Waits until all work this process queued on `device`, on any stream, has
// finished: the fence before device memory is given back (a lease released,
// an allocator destroyed), so no queued kernel writes into memory that
// someone else owns by then. Nothing to wait for on the CPU. Throws
// CudaError (a kernel fault is reported here, late).
void fence_device(Device device);

// Whether this process's CUDA context on `device` can no longer be used: a
// sticky error (a kernel fault here, or under MPS in any client of the GPU,
// or the MPS server gone) that every call now returns. Returns the error's
// name and description, or nullopt when the context works (an ordinary
// error, e.g. out of memory, is cleared by the check). Waits for the
// device. Only a new process can use the GPU again after a loss. nullopt on
// the CPU.
std::optional<std::string> device_context_lost(Device device);

// Test-only: makes the context fail as a buggy kernel would (see
// kernels/fault.h), asynchronously on this thread's compute stream.
void inject_device_fault(Device device);

// How the bfloat16 products choose among cuBLASLt's algorithms: each timed
// at its first call outside a graph's capture (on, the default), or the
// heuristic's first choice (off). The same results either way
// (kernels/matmul.h). Process-wide; nothing without CUDA.
void set_measured_gemm_choice(bool on);

// How many times this process's engine made the host wait for a device: a
// copy to or from host memory, a stream synchronize, a fence. A training
// step in its steady state should make none (each wait costs a time slice
// when several processes share the GPU); tests count them here.
uint64_t host_waits();
// Counts one (the engine's own wait points call it).
void note_host_wait();

// Whether this thread's step is being captured only to trace what it
// allocates (step_graph.h): its tensors' addresses have no memory behind
// them and the captured graph is thrown away, so copies to or from them
// are not queued (a capture checks a copy's addresses, where it records a
// kernel's arguments as they are).
bool tracing_step();
class TracingStepGuard {
 public:
  TracingStepGuard();
  ~TracingStepGuard();
  TracingStepGuard(const TracingStepGuard&) = delete;
  TracingStepGuard& operator=(const TracingStepGuard&) = delete;

 private:
  bool previous_;
};

// TF32 tensor-core math for float32 matmul and conv. Off by default (full
// FP32, as PyTorch's default for matmul). Process-wide.
void set_allow_tf32(bool allow);
bool allow_tf32();

#ifdef LEASEHOLD_HAVE_CUDA
// This thread's compute stream on `device` (created on first use, non-blocking).
cudaStream_t compute_stream(int device);
// The same if this thread made one already; nullptr otherwise. Creates
// nothing and never throws (for frees, which may come from any thread).
cudaStream_t existing_compute_stream(int device) noexcept;
// This thread's copy stream on `device` (created on first use,
// non-blocking): for copies between device and host memory that overlap the
// compute stream's kernels (host_offload.h). Its work is ordered with the
// compute stream's by events only.
cudaStream_t copy_stream(int device);
// This thread's cuBLAS handle on `device`, bound to compute_stream(device).
cublasHandle_t cublas_handle(int device);
// This thread's cuBLASLt handle on `device` (its calls name their stream).
cublasLtHandle_t cublaslt_handle(int device);
// Waits for this thread's work on `device`.
void synchronize(int device);
#endif

}  // namespace leasehold::engine
