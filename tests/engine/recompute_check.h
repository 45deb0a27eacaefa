// One training step of a small GPT (two blocks, dropout on) with its blocks
// keeping their activations or recomputing some in backward, for the tests that
// hold the two to the same loss and gradients (recompute_test.cpp on the
// CPU, cuda_autocast_test.cpp under bfloat16 autocast on a GPU).
#pragma once

#include <cstdint>
#include <vector>

#include "agent/engine/nn.h"

namespace leasehold::engine {

struct RecomputeStep {
  std::vector<float> loss;                      // the step's loss
  std::vector<std::vector<float>> grads;        // every parameter's, in order
  uint64_t kept_bytes = 0;  // allocator bytes alive between forward and backward, over the start
};

// `autocast`: the forward pass under bfloat16 autocast (CUDA only). Backward
// runs after the forward's StepRandom and autocast scopes have ended.
RecomputeStep gpt_step(Device device, nn::TransformerBlock::Recompute recompute, bool autocast);

}  // namespace leasehold::engine
