// Named tensors laid out in a shared cache region (a job's decoded dataset,
// a model's published parameters), so that any agent attached to the region
// can use them in place. Layout (little-endian), described by a header at
// offset 0 that is checked before use:
//   magic "LHREGN1\n" | version u32 | count u32 | data_bytes u64
//   count x entry { name char[64], NUL-padded | dtype u8 | ndim u8 | 6 bytes 0 |
//                   dims i64[6] | offset u64 | bytes u64 }
//   crc32 u32 of everything above
//   the tensors' data, each at a 256-byte aligned offset from the start
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "agent/engine/nn.h"
#include "lease_client/session.h"

namespace leasehold::regions {

inline constexpr char kMagic[8] = {'L', 'H', 'R', 'E', 'G', 'N', '1', '\n'};
inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kMaxName = 63;
inline constexpr size_t kMaxDims = 6;

struct TensorSpec {
  std::string name;  // at most kMaxName bytes
  engine::DType dtype = engine::DType::Float32;
  engine::Shape shape;  // at most kMaxDims dimensions
};

// Bytes a region needs to hold tensors of these specs. Throws
// std::invalid_argument for a name or rank over the limits.
uint64_t packed_size(const std::vector<TensorSpec>& specs);
std::vector<TensorSpec> specs_of(const engine::nn::NamedTensors& tensors);

// Where each tensor's data starts in the region, in spec order.
std::vector<uint64_t> tensor_offsets(const std::vector<TensorSpec>& specs);
// Writes the header describing `specs` into `region` (packed_size() bytes);
// the caller writes the data at tensor_offsets(). Throws like write_tensors.
void write_header(RegionAttachment& region, const std::vector<TensorSpec>& specs);

// The device whose memory the region is: cuda:N on the cuda backend, cpu on host.
engine::Device region_device(const RegionAttachment& region);

// Writes `tensors` (from any device) into `region`, which must be
// packed_size() bytes, and waits until the copies are done (the region may
// be marked ready afterwards). Throws std::invalid_argument for a size
// mismatch, CudaError for a copy that fails.
void write_tensors(RegionAttachment& region, const engine::nn::NamedTensors& tensors);

// Tensors viewing the region's memory (no copies), on region_device(); each
// keeps `region` (and so the attachment) alive; when the last goes, the
// device is fenced before the attachment may be given back. Throws std::runtime_error
// naming the region when its header is not a valid one: wrong magic or
// version, a checksum mismatch, an entry outside the region.
engine::nn::NamedTensors read_tensors(const std::shared_ptr<RegionAttachment>& region);

// XXH3-64 of the tensors' bytes in order (copied to the host): a digest to
// tell two sets of weights apart in logs.
uint64_t tensors_digest(const engine::nn::NamedTensors& tensors);

}  // namespace leasehold::regions
