// Internal helpers of the operator files: dtype dispatch, kernel views of
// tensors, and the CUDA stream of a tensor's device.
#pragma once

#include <stdexcept>
#include <string>

#include "agent/engine/cuda_context.h"
#include "agent/engine/tensor.h"
#include "kernels/strided.h"

namespace leasehold::engine::detail {

template <class F>
decltype(auto) dispatch_floating(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::Float32: return f(float{});
    case DType::Float64: return f(double{});
    default:
      throw std::invalid_argument(std::string(op) + ": expected a floating-point tensor, got " +
                                  dtype_name(t));
  }
}

// The types operators compute in (bfloat16 is storage only: dtype.h).
template <class F>
decltype(auto) dispatch_all(DType t, F&& f) {
  switch (t) {
    case DType::Float32: return f(float{});
    case DType::Float64: return f(double{});
    case DType::Int64: return f(int64_t{});
    case DType::BFloat16: break;
  }
  throw std::invalid_argument(std::string("dtype ") + dtype_name(t) +
                              " is storage only here: convert to float32 with to(), or use "
                              "it through autocast (agent/engine/autocast.h)");
}

// Every type, bfloat16 included: for copies, which only move elements.
template <class F>
decltype(auto) dispatch_storage(DType t, F&& f) {
  if (t == DType::BFloat16) return f(bfloat16{});
  return dispatch_all(t, std::forward<F>(f));
}

// The tensor's own layout (offset 0: pass data<T>(), which includes it).
kernels::Strided strided_of(const Tensor& t);
// The tensor read as if broadcast to `out` (stride 0 on broadcast dims).
kernels::Strided broadcast_strided(const Tensor& t, const Shape& out);

void check_same(const Tensor& a, const Tensor& b, const char* op);
void check_defined(const Tensor& t, const char* op, const char* what);
[[noreturn]] void no_cuda(const char* op);

#ifdef LEASEHOLD_HAVE_CUDA
inline cudaStream_t stream_of(const Tensor& t) { return compute_stream(t.device().index); }
#define LEASEHOLD_CUDA_OR(op, ...) __VA_ARGS__
#else
#define LEASEHOLD_CUDA_OR(op, ...) ::leasehold::engine::detail::no_cuda(op)
#endif

}  // namespace leasehold::engine::detail
