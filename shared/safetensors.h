// Exporting an engine checkpoint (agent/engine/checkpoint.cpp's "LHCKPT"
// format) as safetensors, the format PyTorch, JAX and the Hugging Face tools
// read: an 8-byte little-endian header length, a JSON header naming each
// tensor's dtype, shape and byte range, then the bytes
// (https://github.com/huggingface/safetensors). Both are little-endian
// row-major, so the tensors' bytes are copied as they are.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace leasehold {

// One tensor of a checkpoint, its bytes inside the checkpoint's buffer.
struct CheckpointTensor {
  std::string name;
  std::string dtype;  // safetensors' name: "F32", "F64", "I64"
  std::vector<int64_t> shape;
  std::string_view data;
};

// The tensors of an LHCKPT file's bytes, in file order. Throws
// std::runtime_error naming `what` when it is not one: a wrong magic or
// version, a checksum that does not match, a truncated or oversized entry,
// an unknown element type.
std::vector<CheckpointTensor> read_checkpoint_tensors(std::string_view bytes,
                                                      const std::string& what);

// The safetensors file of `tensors`, with `metadata` as its __metadata__
// (string to string, as the format wants). Names must be unique.
std::string to_safetensors(const std::vector<CheckpointTensor>& tensors,
                           const std::map<std::string, std::string>& metadata);

}  // namespace leasehold
