// Holds fused operators to the operators they fuse, bit for bit, on a
// device: for step_state_test.cpp (CPU) and cuda_ops_test.cpp (a GPU).
#pragma once

#include <string>

#include "agent/engine/tensor.h"

namespace leasehold::engine {

// add_dropout(residual, x) against add(residual, dropout(x)) drawn from the
// same seed, in float32 and float64, over sizes with and without a tail
// past 16-byte words, a residual 16-byte aligned and one element off, p 0.3
// and 0 (and not training), x trained and frozen: the output and the
// gradients the same bits. Returns a description of the first difference,
// or "".
std::string add_dropout_mismatch(Device device);

// A layer norm whose input's other gradient its backward adds as it writes
// dx (autograd.h: Node::fold_into_input0): x + layer_norm(x) against the
// sum of x's two gradients made apart, in float32 and float64, over
// widths through every kernel (a multiple of 4 and not, over the CUDA
// register kernels' 1024, more row chunks than their final sum's lanes):
// every gradient the same bits. Returns the first difference, or "".
std::string layer_norm_fold_mismatch(Device device);

}  // namespace leasehold::engine
