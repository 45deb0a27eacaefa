// The shape each layer of a job's model produces, inferred from the input
// size (an image's [C, H, W], or a text sample's [T] tokens), so that a job
// whose layers do not chain is refused before it runs (by the client, the
// coordinator and the agent alike).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schemas/job_generated.h"

namespace leasehold {

// Shape of one example ([C, H, W], [F], or [T, F] after an Embedding) after
// each layer. Problems are
// appended as "model[i] (Type): ..." and inference stops at the first.
std::vector<std::vector<int64_t>> infer_layer_shapes(
    const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& layers,
    std::vector<int64_t> input, std::vector<std::string>& problems);

}  // namespace leasehold
