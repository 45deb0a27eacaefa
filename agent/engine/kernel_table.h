// One operator's kernels, one per backend, looked up by a tensor's device
// (ggml's shape: the operator is written once, the backends are entries).
// Kernels listed here share one signature whose first argument is the
// stream (kernels::Stream: the device's compute stream on CUDA, null on the
// CPU), so an operator calls table(device)(stream_for(device), ...) and
// never branches on the device itself.
#pragma once

#include <array>
#include <stdexcept>
#include <string>

#include "agent/engine/dtype.h"
#include "kernels/transformer.h"  // kernels::Stream

namespace leasehold::engine {

enum class Backend : uint8_t { CPU, CUDA };
inline constexpr size_t kBackendCount = 2;

inline Backend backend_of(Device d) { return d.is_cuda() ? Backend::CUDA : Backend::CPU; }

// The stream kernels for `d` run on: the device's compute stream on CUDA.
kernels::Stream stream_for(Device d);

// A CUDA kernel's address in builds with CUDA, null (no entry) otherwise.
#ifdef LEASEHOLD_HAVE_CUDA
#define LEASEHOLD_CUDA_KERNEL(...) &__VA_ARGS__
#else
#define LEASEHOLD_CUDA_KERNEL(...) nullptr
#endif

template <class Fn>
struct KernelTable {
  const char* op;
  std::array<Fn*, kBackendCount> kernels;  // indexed by Backend

  // The kernel for `d`'s backend; throws std::invalid_argument naming the
  // operator and device when this build has none.
  Fn& operator()(Device d) const {
    Fn* k = kernels[static_cast<size_t>(backend_of(d))];
    if (k == nullptr) {
      throw std::invalid_argument(std::string(op) + ": no kernel for " + d.str() +
                                  " in this build");
    }
    return *k;
  }
};

// KernelTable<decltype(cpu::f<T>)>{op, {&cpu::f<T>, LEASEHOLD_CUDA_KERNEL(cuda::f<T>)}}.
#define LEASEHOLD_KERNEL_TABLE(op, name, T)                                       \
  ::leasehold::engine::KernelTable<decltype(::leasehold::kernels::cpu::name<T>)>{ \
      op, {&::leasehold::kernels::cpu::name<T>,                                   \
           LEASEHOLD_CUDA_KERNEL(::leasehold::kernels::cuda::name<T>)}}

}  // namespace leasehold::engine
