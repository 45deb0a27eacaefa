// Finite-difference gradient checking in float64 on the CPU.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "agent/engine/tensor.h"

namespace leasehold::engine::testing {

using Fn = std::function<Tensor(const std::vector<Tensor>&)>;

// Checks d/dx_i sum(f(x) * r) by backward against central differences for
// every element of every input (r random, fixed). Inputs must be float64 CPU
// tensors; they are made leaves that require grad. Returns a description of
// the first mismatch, or "" when all agree within `tol` (relative to
// max(1, |numeric|)).
std::string gradcheck(const Fn& f, std::vector<Tensor> inputs, double eps = 1e-6,
                      double tol = 1e-6);

// Largest |a - b| / max(1, |b|) over all elements (same shape, any device).
double max_rel_diff(const Tensor& a, const Tensor& b);

}  // namespace leasehold::engine::testing
