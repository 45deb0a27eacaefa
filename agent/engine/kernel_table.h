// One operator's kernels, one per backend, looked up by a tensor's device
// (ggml's shape: the operator is written once, the backends are entries).
// Kernels listed here share one signature whose first argument is the
// stream (kernels::Stream: the device's compute stream on CUDA, null on the
// CPU), so an operator calls table.run(device, ...) and never branches on
// the device itself. (cuBLAS products take the device instead, for its
// handle: agent/engine/gemm.cpp.)
#pragma once

#include <array>
#include <stdexcept>
#include <string>
#include <utility>

#include "agent/engine/dtype.h"
#include "kernels/stream.h"

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

  // Runs the kernel for `d` on d's stream: run(d, args...) is
  // (*this)(d)(stream_for(d), args...).
  template <class... Args>
  void run(Device d, Args&&... args) const {
    (*this)(d)(stream_for(d), std::forward<Args>(args)...);
  }
};

// KernelTable<decltype(cpu::f<T...>)>{op, {&cpu::f<T...>, LEASEHOLD_CUDA_KERNEL(cuda::f<T...>)}}
// for the kernels::cpu / kernels::cuda pair `name`, instantiated for the
// template arguments that follow.
#define LEASEHOLD_KERNEL_TABLE(op, name, ...)                                               \
  ::leasehold::engine::KernelTable<decltype(::leasehold::kernels::cpu::name<__VA_ARGS__>)>{ \
      op, {&::leasehold::kernels::cpu::name<__VA_ARGS__>,                                   \
           LEASEHOLD_CUDA_KERNEL(::leasehold::kernels::cuda::name<__VA_ARGS__>)}}

}  // namespace leasehold::engine
