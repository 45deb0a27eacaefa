// Checkpoints: named tensors (parameters, optimiser state) in one file that
// survives a crash mid-write: written to FILE.tmp, flushed, renamed over
// FILE, directory flushed. The format is documented in checkpoint.cpp.
#pragma once

#include <string>

#include "agent/engine/nn.h"

namespace leasehold::engine::checkpoint {

inline constexpr char kMagic[8] = {'L', 'H', 'C', 'K', 'P', 'T', '\r', '\n'};
inline constexpr uint32_t kVersion = 1;

// Writes `tensors` (copied to the host). Throws std::runtime_error naming the
// file on I/O failure; the previous file at `path`, if any, is left intact.
void save(const std::string& path, const nn::NamedTensors& tensors);
// Reads a checkpoint into CPU tensors. Throws std::runtime_error naming the
// file for a missing file, a wrong magic number or version, a checksum
// mismatch or truncation.
nn::NamedTensors load(const std::string& path);
// Copies loaded values into `targets` by name (any device). Throws naming
// the first missing or mis-shaped tensor; nothing is copied then.
void restore(const nn::NamedTensors& loaded, const nn::NamedTensors& targets);

}  // namespace leasehold::engine::checkpoint
