#include "agent/region_tensors.h"

#include <spdlog/spdlog.h>
#include <zlib.h>

#include <cstring>
#include <stdexcept>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "shared/units.h"

namespace leasehold::regions {
namespace {

namespace E = engine;

constexpr uint64_t kAlign = 256;

struct Head {
  char magic[8];
  uint32_t version;
  uint32_t count;
  uint64_t data_bytes;
};
struct Entry {
  char name[kMaxName + 1];
  uint8_t dtype;
  uint8_t ndim;
  uint8_t pad[6];
  int64_t dims[kMaxDims];
  uint64_t offset;
  uint64_t bytes;
};
static_assert(sizeof(Head) == 24 && sizeof(Entry) == 136);

uint64_t header_bytes(size_t count) {
  return sizeof(Head) + count * sizeof(Entry) + sizeof(uint32_t);
}

uint64_t tensor_bytes(const TensorSpec& s) {
  return static_cast<uint64_t>(E::numel_of(s.shape)) * E::dtype_size(s.dtype);
}

// Offsets of each tensor's data, and the total size.
std::vector<uint64_t> layout(const std::vector<TensorSpec>& specs, uint64_t& total) {
  std::vector<uint64_t> offsets;
  uint64_t at = align_up(header_bytes(specs.size()), kAlign);
  for (const auto& s : specs) {
    if (s.name.size() > kMaxName) {
      throw std::invalid_argument("region tensor name '" + s.name + "' is longer than " +
                                  std::to_string(kMaxName) + " bytes");
    }
    if (s.shape.size() > kMaxDims) {
      throw std::invalid_argument("region tensor '" + s.name + "' has more than " +
                                  std::to_string(kMaxDims) + " dimensions");
    }
    offsets.push_back(at);
    at = align_up(at + tensor_bytes(s), kAlign);
  }
  total = at;
  return offsets;
}

// Bytes of the region at [offset, offset + n) copied to `dst` on the host.
void read_bytes(const std::shared_ptr<RegionAttachment>& region, uint64_t offset, void* dst,
                size_t n) {
  const E::Device dev = region_device(*region);
  if (!dev.is_cuda()) {
    std::memcpy(dst, region->data() + offset, n);
    return;
  }
  // Whole words, through the engine's copy (its stream, then synchronized).
  const size_t words = (n + 7) / 8;
  E::Tensor view = E::from_blob(region->data() + offset, {static_cast<int64_t>(words)},
                                {E::DType::Int64, dev}, region);
  std::vector<int64_t> host = view.to_vector<int64_t>();
  std::memcpy(dst, host.data(), n);
}

}  // namespace

std::vector<TensorSpec> specs_of(const E::nn::NamedTensors& tensors) {
  std::vector<TensorSpec> specs;
  for (const auto& [name, t] : tensors) specs.push_back({name, t.dtype(), t.sizes()});
  return specs;
}

uint64_t packed_size(const std::vector<TensorSpec>& specs) {
  uint64_t total = 0;
  layout(specs, total);
  return total;
}

E::Device region_device(const RegionAttachment& region) {
  return region.backend() == Backend::Cuda ? E::Device::cuda(region.device()) : E::Device::cpu();
}

std::vector<uint64_t> tensor_offsets(const std::vector<TensorSpec>& specs) {
  uint64_t total = 0;
  return layout(specs, total);
}

void write_header(RegionAttachment& region, const std::vector<TensorSpec>& specs) {
  uint64_t total = 0;
  const auto offsets = layout(specs, total);
  if (total != region.size()) {
    throw std::invalid_argument("region '" + region.name() + "' holds " +
                                std::to_string(region.size()) + " bytes; these tensors need " +
                                std::to_string(total));
  }
  // The header, built on the host. Words, so that it copies as int64.
  std::vector<int64_t> header((align_up(header_bytes(specs.size()), 8)) / 8, 0);
  auto* bytes = reinterpret_cast<char*>(header.data());
  Head head{};
  std::memcpy(head.magic, kMagic, sizeof kMagic);
  head.version = kVersion;
  head.count = static_cast<uint32_t>(specs.size());
  head.data_bytes = total;
  std::memcpy(bytes, &head, sizeof head);
  for (size_t i = 0; i < specs.size(); ++i) {
    Entry e{};
    std::memcpy(e.name, specs[i].name.data(), specs[i].name.size());
    e.dtype = static_cast<uint8_t>(specs[i].dtype);
    e.ndim = static_cast<uint8_t>(specs[i].shape.size());
    for (size_t d = 0; d < specs[i].shape.size(); ++d) e.dims[d] = specs[i].shape[d];
    e.offset = offsets[i];
    e.bytes = tensor_bytes(specs[i]);
    std::memcpy(bytes + sizeof(Head) + i * sizeof(Entry), &e, sizeof e);
  }
  const size_t crc_at = sizeof(Head) + specs.size() * sizeof(Entry);
  const uint32_t crc = static_cast<uint32_t>(
      crc32_z(0L, reinterpret_cast<const Bytef*>(bytes), crc_at));
  std::memcpy(bytes + crc_at, &crc, sizeof crc);

  // A borrowed view keeps nothing alive: the caller holds the attachment.
  E::from_blob(region.data(), {static_cast<int64_t>(header.size())},
               {E::DType::Int64, region_device(region)}, nullptr)
      .copy_(E::from_vector(header, {static_cast<int64_t>(header.size())}));
}

void write_tensors(RegionAttachment& region, const E::nn::NamedTensors& tensors) {
  const auto specs = specs_of(tensors);
  write_header(region, specs);
  const auto offsets = tensor_offsets(specs);
  const E::Device dev = region_device(region);
  E::NoGradGuard no_grad;
  for (size_t i = 0; i < specs.size(); ++i) {
    E::from_blob(region.data() + offsets[i], specs[i].shape, {specs[i].dtype, dev}, nullptr)
        .copy_(tensors[i].second.detach());
  }
  E::fence_device(dev);
}

E::nn::NamedTensors read_tensors(const std::shared_ptr<RegionAttachment>& region) {
  const std::string what = "region '" + region->name() + "'";
  if (region->size() < header_bytes(0)) throw std::runtime_error(what + " is too small for a header");
  Head head{};
  read_bytes(region, 0, &head, sizeof head);
  if (std::memcmp(head.magic, kMagic, sizeof kMagic) != 0) {
    throw std::runtime_error(what + " does not hold tensors (bad magic)");
  }
  if (head.version != kVersion) {
    throw std::runtime_error(what + " has layout version " + std::to_string(head.version) +
                             "; this build reads version " + std::to_string(kVersion));
  }
  if (head.count > 4096 || header_bytes(head.count) > region->size() ||
      head.data_bytes != region->size()) {
    throw std::runtime_error(what + " has an implausible header (" + std::to_string(head.count) +
                             " tensors, " + std::to_string(head.data_bytes) + " bytes)");
  }
  std::vector<char> bytes(header_bytes(head.count));
  read_bytes(region, 0, bytes.data(), bytes.size());
  const size_t crc_at = bytes.size() - sizeof(uint32_t);
  uint32_t stored;
  std::memcpy(&stored, bytes.data() + crc_at, sizeof stored);
  if (crc32_z(0L, reinterpret_cast<const Bytef*>(bytes.data()), crc_at) != stored) {
    throw std::runtime_error(what + " has a corrupt header (checksum mismatch)");
  }
  const E::Device dev = region_device(*region);
  // What the views keep alive: the attachment, given back only after the
  // device work queued on the views has finished (no kernel reads a region
  // that may be evicted by then).
  std::shared_ptr<void> keepalive(region.get(), [region, dev](void*) noexcept {
    try {
      E::fence_device(dev);
    } catch (const std::exception& e) {
      spdlog::error("region '{}': {}", region->name(), e.what());
    }
  });
  E::nn::NamedTensors out;
  for (uint32_t i = 0; i < head.count; ++i) {
    Entry e;
    std::memcpy(&e, bytes.data() + sizeof(Head) + i * sizeof(Entry), sizeof e);
    e.name[kMaxName] = '\0';
    if (e.dtype > static_cast<uint8_t>(E::DType::Int64) || e.ndim > kMaxDims) {
      throw std::runtime_error(what + ": entry " + std::to_string(i) + " is malformed");
    }
    TensorSpec spec{e.name, static_cast<E::DType>(e.dtype), E::Shape(e.dims, e.dims + e.ndim)};
    bool dims_ok = true;
    for (int64_t d : spec.shape) dims_ok &= d >= 0 && d <= (int64_t{1} << 40);
    if (!dims_ok || tensor_bytes(spec) != e.bytes || e.offset % kAlign != 0 ||
        e.offset > region->size() || e.bytes > region->size() - e.offset) {
      throw std::runtime_error(what + ": tensor '" + spec.name + "' lies outside the region");
    }
    out.emplace_back(spec.name, E::from_blob(region->data() + e.offset, spec.shape,
                                             {spec.dtype, dev}, keepalive));
  }
  return out;
}

uint64_t tensors_digest(const E::nn::NamedTensors& tensors) {
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(XXH3_createState(),
                                                                  &XXH3_freeState);
  if (!state) throw std::bad_alloc();
  XXH3_64bits_reset(state.get());
  for (const auto& [name, t] : tensors) {
    E::Tensor host = t.detach().to(E::Device::cpu()).contiguous();
    XXH3_64bits_update(state.get(), host.raw_data(), host.numel() * E::dtype_size(host.dtype()));
  }
  return XXH3_64bits_digest(state.get());
}

}  // namespace leasehold::regions
