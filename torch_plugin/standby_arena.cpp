#include "torch_plugin/standby_arena.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>

#include "torch_plugin/plugin_state.h"

namespace leasehold::torch_plugin {
namespace {

struct Arena {
  std::mutex mu;
  std::unordered_map<void*, uint64_t> live;  // GUARDED_BY(mu): pointer -> bytes
  uint64_t live_bytes = 0;                   // GUARDED_BY(mu)
  bool opened = false;                       // GUARDED_BY(mu)
  std::atomic<bool> active{false};
  std::atomic<bool> any{false};  // anything ever allocated: frees look here
};

Arena& arena() {
  static Arena* a = new Arena;  // never destroyed, as the Plugin
  return *a;
}

}  // namespace

bool standby_arena_open() {
  Arena& a = arena();
  std::lock_guard lk(a.mu);
  if (a.opened || plugin().cache.load(std::memory_order_acquire) != nullptr) {
    print_line("leasehold: the standby arena opens once, before the job's first allocation");
    return false;
  }
  a.opened = true;
  a.active.store(true, std::memory_order_release);
  return true;
}

uint64_t standby_arena_close() {
  Arena& a = arena();
  std::lock_guard lk(a.mu);
  a.active.store(false, std::memory_order_release);
  // Nothing left: the job's frees need not look here any more.
  if (a.live.empty()) a.any.store(false, std::memory_order_release);
  return a.live_bytes;
}

bool standby_arena_active() { return arena().active.load(std::memory_order_acquire); }

void* standby_arena_allocate(uint64_t bytes, int device) {
  Arena& a = arena();
  int previous = 0;
  cudaError_t err = cudaGetDevice(&previous);
  if (err == cudaSuccess && previous != device) err = cudaSetDevice(device);
  void* ptr = nullptr;
  if (err == cudaSuccess) err = cudaMalloc(&ptr, bytes);
  if (previous != device) (void)cudaSetDevice(previous);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky: clear it
    throw std::runtime_error("leasehold: the standby's warm-up allocation of " +
                             std::to_string(bytes) + " bytes on device " + std::to_string(device) +
                             " failed: " + cudaGetErrorString(err));
  }
  std::lock_guard lk(a.mu);
  a.live.emplace(ptr, bytes);
  a.live_bytes += bytes;
  a.any.store(true, std::memory_order_release);
  return ptr;
}

bool standby_arena_free(void* ptr) {
  Arena& a = arena();
  if (!a.any.load(std::memory_order_acquire)) return false;
  {
    std::lock_guard lk(a.mu);
    auto it = a.live.find(ptr);
    if (it == a.live.end()) return false;
    a.live_bytes -= it->second;
    a.live.erase(it);
  }
  // cudaFree waits for the work queued on the memory (it synchronizes).
  if (cudaError_t err = cudaFree(ptr); err != cudaSuccess && err != cudaErrorCudartUnloading) {
    (void)cudaGetLastError();
    print_line(std::string("leasehold: freeing a standby warm-up allocation failed: ") +
               cudaGetErrorString(err));
  }
  return true;
}

}  // namespace leasehold::torch_plugin
