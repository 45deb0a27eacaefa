// The elementwise operator set, written once as functors that CPU loops
// (elementwise_cpu.cpp) and CUDA kernels (elementwise.cu) both apply.
#pragma once

#include <math.h>  // global float overloads of exp, log, ... in host code too
#include <cstdint>

#include "kernels/bfloat16.h"
#include "kernels/pattern.h"  // LEASEHOLD_HOST_DEVICE

namespace leasehold::kernels {

enum class UnaryOp : int {
  Identity,   // copy (gathers a strided view into contiguous memory)
  Neg,
  Exp,
  Log,
  Relu,
  Sigmoid,
  Tanh,
  Sign,
  Sqrt,
  PowScalar,  // x ^ s
  MulScalar,  // x * s
  AddScalar,  // x + s
  GtScalar,   // x > s ? 1 : 0
  Gelu,       // GELU, tanh form: x/2 (1 + tanh(√(2/π) (x + 0.044715 x³)))
};

enum class BinaryOp : int {
  Add,
  Sub,
  Mul,
  Div,
  ReluGrad,      // a = grad, b = relu's input or output: b > 0 ? a : 0
  SigmoidGrad,   // a = grad, b = output:  a * b * (1 - b)
  TanhGrad,      // a = grad, b = output:  a * (1 - b^2)
  PowScalarGrad, // a = grad, b = input:   a * s * b^(s-1)
  Eq,            // a == b ? 1 : 0
  GeluGrad,      // a = grad, b = input:   a * gelu'(b)
};

// GELU's tanh form and its derivative (PyTorch's approximate="tanh").
template <class T>
LEASEHOLD_HOST_DEVICE inline T gelu_tanh(T x) {
  const T k = T(0.7978845608028654);  // √(2/π)
  return T(0.5) * x * (T(1) + tanh(k * (x + T(0.044715) * x * x * x)));
}
template <class T>
LEASEHOLD_HOST_DEVICE inline T gelu_tanh_grad(T x) {
  const T k = T(0.7978845608028654);
  const T th = tanh(k * (x + T(0.044715) * x * x * x));
  return T(0.5) * (T(1) + th) +
         T(0.5) * x * (T(1) - th * th) * k * (T(1) + T(3 * 0.044715) * x * x);
}

// GELU's backward at one element of a bfloat16 product's fused GELU: g ·
// gelu'(x) in float32, rounded once to bfloat16. Every kernel that writes
// that gradient computes it here, so they give the same bits.
LEASEHOLD_HOST_DEVICE inline bfloat16 gelu_grad_bf16(bfloat16 g, bfloat16 x) {
  return bfloat16(float(g) * gelu_tanh_grad(float(x)));
}

template <class T>
LEASEHOLD_HOST_DEVICE inline T apply_unary(UnaryOp op, T x, T s) {
  switch (op) {
    case UnaryOp::Identity: return x;
    case UnaryOp::Neg: return -x;
    case UnaryOp::Exp: return exp(x);
    case UnaryOp::Log: return log(x);
    case UnaryOp::Relu: return x > T(0) ? x : T(0);
    case UnaryOp::Sigmoid: return T(1) / (T(1) + exp(-x));
    case UnaryOp::Tanh: return tanh(x);
    case UnaryOp::Sign: return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0));
    case UnaryOp::Sqrt: return sqrt(x);
    case UnaryOp::PowScalar: return pow(x, s);
    case UnaryOp::MulScalar: return x * s;
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::GtScalar: return x > s ? T(1) : T(0);
    case UnaryOp::Gelu: return gelu_tanh(x);
  }
  return x;
}

template <class T>
LEASEHOLD_HOST_DEVICE inline T apply_binary(BinaryOp op, T a, T b, T s) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Div: return a / b;
    case BinaryOp::ReluGrad: return b > T(0) ? a : T(0);
    case BinaryOp::SigmoidGrad: return a * b * (T(1) - b);
    case BinaryOp::TanhGrad: return a * (T(1) - b * b);
    case BinaryOp::PowScalarGrad: return a * s * pow(b, s - T(1));
    case BinaryOp::Eq: return a == b ? T(1) : T(0);
    case BinaryOp::GeluGrad: return a * gelu_tanh_grad(b);
  }
  return a;
}

// Integer types support only data movement and comparisons.
template <>
LEASEHOLD_HOST_DEVICE inline int64_t apply_unary<int64_t>(UnaryOp op, int64_t x, int64_t s) {
  switch (op) {
    case UnaryOp::Neg: return -x;
    case UnaryOp::MulScalar: return x * s;
    case UnaryOp::AddScalar: return x + s;
    case UnaryOp::GtScalar: return x > s ? 1 : 0;
    default: return x;
  }
}
template <>
LEASEHOLD_HOST_DEVICE inline int64_t apply_binary<int64_t>(BinaryOp op, int64_t a, int64_t b,
                                                           int64_t) {
  switch (op) {
    case BinaryOp::Add: return a + b;
    case BinaryOp::Sub: return a - b;
    case BinaryOp::Mul: return a * b;
    case BinaryOp::Eq: return a == b ? 1 : 0;
    default: return a;
  }
}

// Counter-based random numbers (splitmix64 of seed and index): the same
// stream on CPU and GPU, so dropout masks agree across devices.
LEASEHOLD_HOST_DEVICE inline double uniform01(uint64_t seed, uint64_t index) {
  return static_cast<double>(pattern_word(seed, index) >> 11) * (1.0 / 9007199254740992.0);
}

// Where a random stream's seed comes from. `seed` alone, or mixed with the
// value at `step` (a counter in the kernel's memory) when that is set: a
// training step captured as a CUDA graph bakes its seeds into the graph, and
// the step counter the graph advances gives each replay (and each step run
// op by op) masks of its own.
struct RandomKey {
  uint64_t seed = 0;
  const int64_t* step = nullptr;
  LEASEHOLD_HOST_DEVICE uint64_t resolve() const {
    return step ? pattern_word(seed, static_cast<uint64_t>(*step)) : seed;
  }
};

// Dropout keeps element `index` when uniform01(seed, index) >= p. That is
// an integer comparison of the 53 bits uniform01 scales, against
// ceil(p · 2^53) (exact in double): the same decision without the
// conversion to double, which dominated the GPU kernel.
inline uint64_t dropout_threshold(double p) {
  return static_cast<uint64_t>(::ceil(p * 9007199254740992.0));
}
LEASEHOLD_HOST_DEVICE inline bool dropout_keeps(uint64_t seed, uint64_t index, uint64_t threshold) {
  return (pattern_word(seed, index) >> 11) >= threshold;
}

// low + span * uniform01(seed, index), rounded the same way on both sides
// (the device would otherwise fuse it into one multiply-add).
LEASEHOLD_HOST_DEVICE inline double uniform_between(uint64_t seed, uint64_t index, double low,
                                                    double span) {
  const double u = uniform01(seed, index);
#ifdef __CUDA_ARCH__
  return __dadd_rn(low, __dmul_rn(span, u));
#else
  return low + span * u;
#endif
}

}  // namespace leasehold::kernels
