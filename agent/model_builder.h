// Builds an engine model from a job's layer list, and infers the shape each
// layer produces so a job whose layers do not chain is refused before it runs.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "agent/engine/nn.h"
#include "schemas/job_generated.h"

namespace leasehold {

// Shape of one example ([C, H, W] or [F]) after each layer. Problems are
// appended as "model[i] (Type): ..." and inference stops at the first.
std::vector<std::vector<int64_t>> infer_layer_shapes(
    const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& layers,
    std::vector<int64_t> input, std::vector<std::string>& problems);

// The model, parameters on `options.device`. REQUIRES: infer_layer_shapes
// found no problem for this input.
std::shared_ptr<engine::nn::Sequential> build_model(
    const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& layers,
    engine::TensorOptions options);

}  // namespace leasehold
