// Holds a small GPT's training step (two blocks, dropout on) with its
// blocks recomputing in backward to the same step with every activation
// kept, for recompute_test.cpp (CPU) and cuda_autocast_test.cpp (bfloat16
// autocast on a GPU).
#pragma once

#include <string>

#include "agent/engine/tensor.h"

namespace leasehold::engine {

// Runs the step keeping everything, then with every block's MLP, every
// block's two halves and every whole block recomputed. Returns a
// description of the first thing that does not hold, or "" when the loss
// and every gradient are the same bit for bit, the memory alive between
// forward and backward is less with the MLPs recomputed, less again with
// the halves and again with whole blocks, and under half of everything
// kept, and backward needs less at once over that with the halves than
// with whole blocks; whole blocks in halves keep what whole blocks keep
// and need less at once in backward; each mode again with its segments' inputs offloaded
// to host memory gives the same bits and keeps less. `autocast`: the forward passes under bfloat16
// autocast (CUDA only); backward runs after the forward's StepRandom and
// autocast scopes have ended (a recomputed segment brings back its own).
std::string recompute_mismatch(Device device, bool autocast);

// Each recompute mode again with every block's MLP run again in four
// slices of the batch (TransformerBlock::set_mlp_parts): "" when the loss
// is the same bit for bit, every gradient within rounding of the step
// that keeps everything (float32 sums in another order), each
// parameter's gradient-ready hook called once, the same bytes kept
// between forward and backward, and, where whole blocks run again, less
// needed at once in backward than with their MLPs run again whole; else
// what does not hold.
std::string sliced_mlp_mismatch(Device device, bool autocast);

// A product (with and without a fused ReLU, which on a GPU reads its
// output in backward) and a dropout's addition onto a residual (p 0.5 and
// 0), made under an OutputsUnreadGuard and not: "" when every gradient is
// the same bit for bit, else what differs.
std::string outputs_unread_mismatch(Device device);

}  // namespace leasehold::engine
