// validate_job's checks for a text dataset (`name: text`) and for the
// language model it trains: what a job file must say, before any of it
// runs, for next-token training on bytes to work.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "schemas/job_generated.h"

namespace leasehold {

// The dataset: its files (regular and readable, when `check_files`), a
// context in [1, kMaxTextContext], a held-out fraction in (0, 1) that
// leaves both parts a sample, a corpus within a quarter of `budget` (0:
// none); no image fields. Appends each problem to `problems`.
void check_text_dataset(const proto::DatasetSpec& dataset, bool check_files, uint64_t budget,
                        std::vector<std::string>& problems);

// The model: an Embedding of all kTextVocabulary byte values first, and
// (when every layer's shape is known, `shapes` from infer_layer_shapes of
// `input`) next-token scores [tokens, kTextVocabulary] last.
void check_text_model(const flatbuffers::Vector<flatbuffers::Offset<proto::Layer>>& model,
                      const std::vector<std::vector<int64_t>>& shapes,
                      const std::vector<int64_t>& input, std::vector<std::string>& problems);

}  // namespace leasehold
