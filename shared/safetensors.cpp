#include "shared/safetensors.h"

#include <zlib.h>

#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

namespace leasehold {
namespace {

// agent/engine/checkpoint.cpp writes these; agent/engine/dtype.h's DType
// values (checked there) are the element-type bytes.
constexpr char kMagic[8] = {'L', 'H', 'C', 'K', 'P', 'T', '\r', '\n'};
constexpr uint32_t kVersion = 1;
constexpr const char* kDTypes[] = {"F32", "F64", "I64", "BF16"};
constexpr size_t kDTypeBytes[] = {4, 8, 8, 2};
constexpr uint32_t kMaxDims = 8;

class Reader {
 public:
  Reader(std::string_view d, const std::string& what) : d_(d), what_(what) {}
  template <class T>
  T get(const char* field) {
    T v;
    std::memcpy(&v, take(sizeof v, field).data(), sizeof v);
    return v;
  }
  std::string_view take(uint64_t n, const char* field) {
    if (n > d_.size() - pos_) throw std::runtime_error(what_ + " is truncated (reading " + field + ")");
    std::string_view out = d_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  size_t pos() const { return pos_; }

 private:
  std::string_view d_;
  const std::string& what_;
  size_t pos_ = 0;
};

}  // namespace

std::vector<CheckpointTensor> read_checkpoint_tensors(std::string_view bytes,
                                                      const std::string& what) {
  if (bytes.size() < sizeof kMagic + 12 || std::memcmp(bytes.data(), kMagic, sizeof kMagic) != 0) {
    throw std::runtime_error(what + " is not a Leasehold checkpoint (no LHCKPT magic)");
  }
  // The CRC covers everything after the magic up to itself.
  const std::string_view body = bytes.substr(sizeof kMagic, bytes.size() - sizeof kMagic - 4);
  uint32_t stored;
  std::memcpy(&stored, bytes.data() + bytes.size() - 4, 4);
  uLong crc = crc32(0L, Z_NULL, 0);
  for (size_t at = 0; at < body.size(); at += 1u << 30) {
    const size_t n = std::min<size_t>(1u << 30, body.size() - at);
    crc = crc32(crc, reinterpret_cast<const Bytef*>(body.data() + at), static_cast<uInt>(n));
  }
  if (static_cast<uint32_t>(crc) != stored) {
    throw std::runtime_error(what + " is damaged (its checksum does not match)");
  }
  Reader r(body, what);
  if (uint32_t v = r.get<uint32_t>("version"); v != kVersion) {
    throw std::runtime_error(what + " has checkpoint version " + std::to_string(v) + ", not " +
                             std::to_string(kVersion));
  }
  const uint32_t count = r.get<uint32_t>("the tensor count");
  std::vector<CheckpointTensor> out;
  for (uint32_t i = 0; i < count; ++i) {
    CheckpointTensor t;
    const uint32_t name_len = r.get<uint32_t>("a name's length");
    t.name = std::string(r.take(name_len, "a name"));
    const uint8_t dtype = r.get<uint8_t>("an element type");
    if (dtype >= std::size(kDTypes)) {
      throw std::runtime_error(what + ": tensor '" + t.name + "' has an unknown element type " +
                               std::to_string(dtype));
    }
    t.dtype = kDTypes[dtype];
    const uint32_t ndim = r.get<uint32_t>("a rank");
    if (ndim > kMaxDims) throw std::runtime_error(what + ": tensor '" + t.name + "' has rank " + std::to_string(ndim));
    uint64_t elements = 1;
    for (uint32_t d = 0; d < ndim; ++d) {
      const int64_t n = r.get<int64_t>("a dimension");
      if (n < 0 || __builtin_mul_overflow(elements, static_cast<uint64_t>(n), &elements)) {
        throw std::runtime_error(what + ": tensor '" + t.name + "' has an impossible shape");
      }
      t.shape.push_back(n);
    }
    uint64_t expected = 0;
    if (__builtin_mul_overflow(elements, kDTypeBytes[dtype], &expected)) {
      throw std::runtime_error(what + ": tensor '" + t.name + "' has an impossible shape");
    }
    const uint64_t nbytes = r.get<uint64_t>("a byte count");
    if (nbytes != expected) {
      throw std::runtime_error(what + ": tensor '" + t.name + "' holds " + std::to_string(nbytes) +
                               " bytes for " + std::to_string(elements) + " elements");
    }
    t.data = r.take(nbytes, "tensor data");
    out.push_back(std::move(t));
  }
  if (r.pos() != body.size()) throw std::runtime_error(what + " has bytes after its last tensor");
  return out;
}

std::string to_safetensors(const std::vector<CheckpointTensor>& tensors,
                           const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::set<std::string> names;
  uint64_t offset = 0;
  for (const auto& t : tensors) {
    if (!names.insert(t.name).second || t.name == "__metadata__") {
      throw std::runtime_error("tensor name '" + t.name + "' appears twice");
    }
    header[t.name] = {{"dtype", t.dtype},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string json = header.dump();
  // The data starts 8-byte aligned (readers map it in place): pad with spaces.
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + json.size() + offset);
  const uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out += json;
  for (const auto& t : tensors) out.append(t.data);
  return out;
}

}  // namespace leasehold
