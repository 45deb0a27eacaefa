// Addresses with no memory behind them, for a training step that is
// captured only to learn what it allocates (step_graph.h: a CUDA graph's
// trace). Its kernels are recorded into a graph that is thrown away and
// never run, so its tensors need addresses but no bytes: the step's memory
// is then known, and laid out, without the step ever holding it. The
// addresses are a reserved range (CUDA: cuMemAddressReserve; the CPU: a
// mapping nothing may touch), so none of them is ever a real tensor's too
// (operators compare addresses, for tensors that alias).
//
// Thread safety: one thread at a time (the pool's lock).
#pragma once

#include <cstdint>

#include "agent/engine/dtype.h"
#include "shared/pool_allocator.h"

namespace leasehold::engine {

class TraceAddresses {
 public:
  // At least `bytes` of addresses for `device`; throws std::runtime_error
  // when they cannot be reserved.
  TraceAddresses(Device device, uint64_t bytes);
  ~TraceAddresses();
  TraceAddresses(const TraceAddresses&) = delete;
  TraceAddresses& operator=(const TraceAddresses&) = delete;

  // An address for `bytes`, aligned to `kAlignment`, placed as the pool
  // allocator places a lease (shared/pool_allocator.h: best fit, from the
  // low end; runs given back merge with their neighbours), so a step whose
  // sizes change (slices of a batch, an epoch's last batch) reuses them as
  // a heap does. Throws OutOfMemoryError when no free run holds it.
  void* take(uint64_t bytes);
  // Gives back the addresses take() returned at `p`. Throws
  // std::invalid_argument for an address it did not return.
  void give_back(void* p);

  // A trace's and an arena's places alike (step_graph.cpp), so that what a
  // step decides from its tensors' alignment is the same in both: the
  // lease allocator's granularity, and more than CUDA's 256 bytes.
  static constexpr uint64_t kAlignment = 512;

 private:
  Device device_;
  char* base_ = nullptr;
  uint64_t bytes_ = 0;
  PoolAllocator places_;  // offsets into [base_, base_ + bytes_)
};

}  // namespace leasehold::engine
