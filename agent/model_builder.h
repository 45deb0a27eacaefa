// Builds an engine model from a job's layer list (shared/layer_shapes.h
// checks first that the layers chain).
#pragma once

#include <memory>

#include "agent/engine/nn.h"
#include "schemas/job_generated.h"

namespace leasehold {

// The model, parameters on `options.device`. REQUIRES: infer_layer_shapes
// found no problem for this input.
std::shared_ptr<engine::nn::Sequential> build_model(
    const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& layers,
    engine::TensorOptions options);

}  // namespace leasehold
