#include "agent/engine/step_graph.h"

#include <spdlog/spdlog.h>

#include <stdexcept>

#include "agent/engine/cuda_context.h"
#include "shared/units.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "shared/cuda_check.h"
#endif

namespace leasehold::engine {

GraphPool::GraphPool(std::shared_ptr<Allocator> upstream) : upstream_(std::move(upstream)) {}

GraphPool::~GraphPool() {
  // (Work queued on the stream that still uses a block runs before any
  // later work in it: the blocks go back as any tensor's memory does.)
  for (auto& [ptr, bytes] : blocks_) upstream_->deallocate(ptr, bytes);
}

void* GraphPool::allocate(size_t bytes) {
  std::lock_guard lock(mu_);
  ++stats_.allocations;
  // A free block of this size; while capturing from an upstream on the
  // stream, else the smallest larger one (memory the step has, rather than
  // none).
  auto it = free_.find(bytes);
  if ((it == free_.end() || it->second.empty()) && capturing_ && upstream_->on_stream()) {
    it = free_.upper_bound(bytes);
    while (it != free_.end() && it->second.empty()) ++it;
  }
  if (it != free_.end() && !it->second.empty()) {
    void* p = it->second.back();
    it->second.pop_back();
    stats_.cached_bytes -= it->first;
    stats_.in_use_bytes += it->first;
    stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
    return p;
  }
  if (capturing_ && upstream_->on_stream()) {
    throw std::runtime_error("the captured step needs " + format_bytes(bytes) +
                             " more than its recording held, from an allocator on the stream");
  }
  blocks_.reserve(blocks_.size() + 1);
  size_of_.reserve(size_of_.size() + 1);
  void* p = upstream_->allocate(bytes);
  blocks_.emplace_back(p, bytes);
  size_of_.emplace(p, bytes);
  stats_.in_use_bytes += bytes;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  return p;
}

void GraphPool::deallocate(void* ptr, size_t) noexcept {
  std::lock_guard lock(mu_);
  const size_t bytes = size_of_.at(ptr);  // (the block's size, which may exceed the request's)
  stats_.in_use_bytes -= bytes;
  try {
    free_[bytes].push_back(ptr);
  } catch (const std::bad_alloc&) {
    // Kept out of reuse; still returned upstream with the pool.
    spdlog::error("graph pool: no memory to list a free block of {}", format_bytes(bytes));
    return;
  }
  stats_.cached_bytes += bytes;
}

AllocatorStats GraphPool::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void GraphPool::set_capturing(bool capturing) {
  std::lock_guard lock(mu_);
  capturing_ = capturing;
}

uint64_t GraphPool::held_bytes() const {
  std::lock_guard lock(mu_);
  uint64_t n = 0;
  for (const auto& b : blocks_) n += b.second;
  return n;
}

StepGraph::StepGraph(Device device, std::function<void()> step)
    : device_(device), step_(std::move(step)) {
  if (!device_.is_cuda()) why_not_ = "CUDA graphs are for CUDA devices; this step runs on the CPU";
}

StepGraph::~StepGraph() {
#ifdef LEASEHOLD_HAVE_CUDA
  if (!exec_) return;
  // The last launch finishes before its graph goes (a job stopped between
  // steps has not waited for it); a fault there is the next call's to report.
  if (cudaStream_t stream = existing_compute_stream(device_.index)) {
    note_host_wait();
    (void)cudaStreamSynchronize(stream);
  }
  cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(exec_));
#endif
}

bool StepGraph::run() {
  if (exec_) {
    launch();
    return true;
  }
  if (!why_not_.empty()) return false;
  if (!recorded_) {
    pool_ = std::make_shared<GraphPool>(current_allocator(device_));
    try {
      AllocatorGuard use_pool(pool_);
      step_();
      recorded_ = true;
      return true;
    } catch (const OutOfMemoryError& e) {
      why_not_ = std::string("recording it for a CUDA graph ran out of memory: ") + e.what();
    }
  } else if (capture()) {
    launch();
    return true;
  }
  spdlog::warn("the training step runs op by op: {}", why_not_);
  pool_.reset();  // (its memory goes when the step's tensors in it do)
  return false;
}

#ifdef LEASEHOLD_HAVE_CUDA
bool StepGraph::capture() {
  cudaStream_t stream = compute_stream(device_.index);
  cudaGraph_t graph = nullptr;
  std::string failure;
  {
    // Frees of memory outside the pool wait for the capture's end; the
    // pool's own are reused within it (step_graph.h, allocator.h).
    DeferFreesGuard defer(pool_.get());
    AllocatorGuard use_pool(pool_);
    pool_->set_capturing(true);
    // Relaxed: the lease allocator may map pages while the stream is
    // captured (not a stream operation, and safe to capture around).
    cudaError_t err = cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      pool_->set_capturing(false);
      why_not_ = std::string("cannot capture the compute stream: ") + cudaGetErrorString(err);
      return false;
    }
    try {
      step_();
    } catch (const std::exception& e) {
      failure = e.what();
    }
    err = cudaStreamEndCapture(stream, &graph);
    pool_->set_capturing(false);
    if (failure.empty() && err != cudaSuccess) {
      failure = std::string("the capture was invalidated: ") + cudaGetErrorString(err);
    }
    if (failure.empty() && !defer.all_deferred()) failure = "a free during the capture was not deferred";
    (void)cudaGetLastError();
  }
  if (failure.empty()) {
    cudaGraphExec_t exec = nullptr;
    cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    if (err == cudaSuccess) {
      exec_ = exec;
    } else {
      (void)cudaGetLastError();
      failure = std::string("cannot instantiate the step's graph: ") + cudaGetErrorString(err);
    }
  }
  if (graph) cudaGraphDestroy(graph);
  if (!failure.empty()) {
    why_not_ = "capturing it as a CUDA graph failed: " + failure;
    return false;
  }
  spdlog::info("the training step is a CUDA graph now ({} of memory for its tensors)",
               format_bytes(pool_->held_bytes()));
  return true;
}

void StepGraph::launch() {
  LEASEHOLD_CUDA_CHECK(
      cudaGraphLaunch(static_cast<cudaGraphExec_t>(exec_), compute_stream(device_.index)));
  ++launches_;
}
#else
bool StepGraph::capture() {
  why_not_ = "this build has no CUDA";
  return false;
}
void StepGraph::launch() { throw std::logic_error("StepGraph::launch without CUDA"); }
#endif

}  // namespace leasehold::engine
