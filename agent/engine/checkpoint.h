// Checkpoints: named tensors (parameters, optimiser state) in one file that
// survives a crash mid-write: written to FILE.tmp.PID, flushed, renamed over
// FILE, directory flushed. The format is documented in checkpoint.cpp. All
// file access goes through a FileSystem so that tests can inject failures.
#pragma once

#include <string>

#include "agent/engine/nn.h"
#include "shared/file_system.h"

namespace leasehold::engine::checkpoint {

inline constexpr char kMagic[8] = {'L', 'H', 'C', 'K', 'P', 'T', '\r', '\n'};
inline constexpr uint32_t kVersion = 1;

// Writes `tensors` (copied to the host, one at a time) to PATH.tmp.PID (one
// per writing process), syncs and closes it, renames it over `path` and syncs the directory; the directory
// must exist. On return the new checkpoint is durable. On failure throws
// std::runtime_error naming `path` and the failed step's file and error, and
// removes PATH.tmp.PID (best effort). A crash or failure at any step leaves a
// complete checkpoint at `path`: the previous one, or, when only the final
// directory sync failed, possibly already the new one.
void save(const std::string& path, const nn::NamedTensors& tensors,
          FileSystem& fs = default_file_system());
// Reads a checkpoint into CPU tensors. Throws std::runtime_error naming the
// file for a missing or unreadable file, a wrong magic number or version, a
// checksum mismatch or truncation.
// A file over `max_bytes` is refused before it is read (the caller knows
// how large its model's checkpoint can be).
nn::NamedTensors load(const std::string& path, FileSystem& fs = default_file_system(),
                      size_t max_bytes = SIZE_MAX);
// Copies loaded values into `targets` by name (any device). Throws naming
// the first missing or mis-shaped tensor; nothing is copied then.
void restore(const nn::NamedTensors& loaded, const nn::NamedTensors& targets);

}  // namespace leasehold::engine::checkpoint
