// The operators' test cases, listed once: the float64 gradcheck
// (gradcheck_test.cpp), the CUDA-against-CPU comparison (cuda_ops_test.cpp)
// and the operator benchmark (tests/bench/engine_bench.cpp) all read this
// list, so a new operator is added here and nowhere else.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "agent/engine/tensor.h"

namespace leasehold::engine::testing {

struct OpCase {
  std::string name;
  // The differentiable inputs, as float64 CPU tensors drawn from the engine
  // generator (callers seed it and convert to their dtype and device).
  std::function<std::vector<Tensor>()> inputs;
  // The operator; anything else it needs (indices) it makes on the inputs'
  // device.
  std::function<Tensor(const std::vector<Tensor>&)> fn;
  // Small enough for finite differences in every element (the CUDA
  // comparison runs every case; larger shapes test the kernels' tiles).
  bool gradcheck = true;
  // CUDA against CPU in float32, relative to max(1, |cpu|).
  double cuda_tolerance = 1e-4;
  // The gradcheck's tolerance (a convolution sums more terms).
  double gradcheck_tolerance = 1e-6;
};

const std::vector<OpCase>& op_cases();

// The same softmax(q kᵀ / √d [+ causal mask]) v from matmul and softmax,
// with its [t, t] scores in memory: the fused kernel's reference.
Tensor reference_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool causal);

}  // namespace leasehold::engine::testing
