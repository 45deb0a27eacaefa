// A small learnable IDX dataset for job tests: 8x8 images in three classes
// (bright left half, right half, top half, plus noise).
#pragma once

#include <string>

namespace leasehold::testing {

// Writes DIR/PREFIX-images and DIR/PREFIX-labels with `n` examples.
void write_synthetic_idx(const std::string& dir, const std::string& prefix, int n, unsigned seed);

// A job file's JSON for a small MLP (64 -> hidden -> 3) on the synthetic
// data in `dir`; `extra` is appended inside the top-level object
// (", \"epochs\": 3", ...). A wider hidden layer makes epochs slower.
std::string synthetic_job_json(const std::string& dir, const std::string& name,
                               const std::string& extra, int hidden = 16);

}  // namespace leasehold::testing
