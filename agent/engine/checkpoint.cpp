// File format (little-endian):
//   magic "LHCKPT\r\n" (8 bytes) | version u32 | count u32
//   count × { name_len u32 | name | dtype u8 | ndim u32 | dims i64 × ndim |
//             nbytes u64 | data }
//   crc32 u32 of everything after the magic, up to here
#include "agent/engine/checkpoint.h"

#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <stdexcept>
#include <string_view>

#include "agent/engine/autograd.h"
#include "shared/printable.h"

namespace leasehold::engine::checkpoint {
namespace {

// shared/safetensors.cpp reads these bytes as element types.
static_assert(static_cast<uint8_t>(DType::Float32) == 0 && static_cast<uint8_t>(DType::Float64) == 1 &&
              static_cast<uint8_t>(DType::Int64) == 2 && static_cast<uint8_t>(DType::BFloat16) == 3);

// Appends are at most this large, so that saving holds one chunk and one
// tensor's host copy in memory rather than a copy of the whole checkpoint.
constexpr size_t kChunkBytes = size_t{1} << 20;

[[noreturn]] void fail(const std::string& path, const Status& status) {
  throw std::runtime_error("cannot save checkpoint " + path + ": " + status.message());
}

void check(const std::string& path, const Status& status) {
  if (!status.ok()) fail(path, status);
}

// Streams the file through `file` in chunks, keeping the CRC of everything
// after the magic. Throws (via fail) when an append fails.
class Writer {
 public:
  Writer(WritableFile& file, const std::string& path) : file_(file), path_(path) {
    buffer_.reserve(kChunkBytes);
  }
  // Bytes outside the checksum (the magic).
  void raw(const void* data, size_t n) { add(static_cast<const char*>(data), n); }
  void bytes(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    // Checksummed piecewise: crc32 takes a 32-bit length.
    for (size_t done = 0; done < n; done += kChunkBytes) {
      size_t len = std::min(kChunkBytes, n - done);
      crc_ = crc32(crc_, reinterpret_cast<const Bytef*>(p + done), static_cast<uInt>(len));
    }
    add(p, n);
  }
  template <class T>
  void put(T v) {
    bytes(&v, sizeof v);
  }
  // Appends the CRC and whatever is still buffered.
  void finish() {
    uint32_t crc = static_cast<uint32_t>(crc_);
    raw(&crc, sizeof crc);
    if (!buffer_.empty()) check(path_, file_.append(buffer_));
    buffer_.clear();
  }

 private:
  void add(const char* p, size_t n) {
    while (n > 0) {
      size_t take = std::min(n, kChunkBytes - buffer_.size());
      buffer_.append(p, take);
      p += take;
      n -= take;
      if (buffer_.size() == kChunkBytes) {
        check(path_, file_.append(buffer_));
        buffer_.clear();
      }
    }
  }

  WritableFile& file_;
  const std::string& path_;
  std::string buffer_;
  uLong crc_ = crc32(0L, Z_NULL, 0);
};

class Reader {
 public:
  Reader(std::string_view data, const std::string& path) : d_(data), path_(path) {}
  template <class T>
  T get(const char* what) {
    T v;
    bytes(&v, sizeof v, what);
    return v;
  }
  void bytes(void* dst, size_t n, const char* what) {
    if (n > d_.size() - pos_) {
      throw std::runtime_error(path_ + " is truncated (reading " + what + ")");
    }
    std::memcpy(dst, d_.data() + pos_, n);
    pos_ += n;
  }
  size_t pos() const { return pos_; }
  size_t left() const { return d_.size() - pos_; }

 private:
  std::string_view d_;
  std::string path_;
  size_t pos_ = 0;
};

}  // namespace

void save(const std::string& path, const nn::NamedTensors& tensors, FileSystem& fs) {
  // One temporary file per writing process: two runs of one job (an agent
  // that has not noticed yet that its job went elsewhere) never write into
  // the same file; the renames are atomic, so the checkpoint is whole.
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  std::unique_ptr<WritableFile> file;
  check(path, fs.new_writable_file(tmp, &file));
  try {
    Writer w(*file, path);
    w.raw(kMagic, sizeof kMagic);
    w.put<uint32_t>(kVersion);
    w.put<uint32_t>(static_cast<uint32_t>(tensors.size()));
    for (const auto& [name, t] : tensors) {
      Tensor host = t.detach().to(Device::cpu()).contiguous();
      w.put<uint32_t>(static_cast<uint32_t>(name.size()));
      w.bytes(name.data(), name.size());
      w.put<uint8_t>(static_cast<uint8_t>(host.dtype()));
      w.put<uint32_t>(static_cast<uint32_t>(host.dim()));
      for (int64_t d : host.sizes()) w.put<int64_t>(d);
      uint64_t nbytes = host.numel() * dtype_size(host.dtype());
      w.put<uint64_t>(nbytes);
      w.bytes(host.raw_data(), nbytes);
    }
    w.finish();
    check(path, file->sync());
    check(path, file->close());
  } catch (...) {
    file.reset();  // closes it if still open
    // Best effort: the failure may also prevent the removal (a dead disk).
    (void)fs.remove(tmp);
    throw;
  }
  if (Status st = fs.rename(tmp, path); !st.ok()) {
    (void)fs.remove(tmp);
    fail(path, st);
  }
  // Until the directory is synced a crash can still bring back the previous
  // file, so a failure here means the save is not done.
  std::string dir = std::filesystem::path(path).parent_path().string();
  check(path, fs.sync_dir(dir.empty() ? "." : dir));
}

nn::NamedTensors load(const std::string& path, FileSystem& fs, size_t max_bytes) {
  std::string data;
  if (Status st = fs.read_file(path, &data, max_bytes); !st.ok()) {
    throw std::runtime_error("cannot open checkpoint " + path + ": " +
                             (st.is_not_found() ? std::strerror(ENOENT) : st.message()));
  }
  if (data.size() < sizeof kMagic + 12 || std::memcmp(data.data(), kMagic, sizeof kMagic) != 0) {
    throw std::runtime_error(path + " is not a Leasehold checkpoint (bad magic)");
  }
  std::string_view body(data);
  body.remove_prefix(sizeof kMagic);
  uint32_t stored_crc;
  std::memcpy(&stored_crc, body.data() + body.size() - 4, 4);
  body.remove_suffix(4);
  if (crc32_z(0L, reinterpret_cast<const Bytef*>(body.data()), body.size()) != stored_crc) {
    throw std::runtime_error(path + " is corrupt (checksum mismatch)");
  }
  Reader r(body, path);
  uint32_t version = r.get<uint32_t>("version");
  if (version != kVersion) {
    throw std::runtime_error(path + " has checkpoint version " + std::to_string(version) +
                             "; this build reads version " + std::to_string(kVersion));
  }
  uint32_t count = r.get<uint32_t>("count");
  nn::NamedTensors out;
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t len = r.get<uint32_t>("name length");
    if (len > 4096) throw std::runtime_error(path + ": implausible name length");
    std::string name(len, '\0');
    r.bytes(name.data(), len, "name");
    uint8_t dt = r.get<uint8_t>("dtype");
    if (dt > static_cast<uint8_t>(DType::BFloat16)) throw std::runtime_error(path + ": bad dtype");
    uint32_t ndim = r.get<uint32_t>("rank");
    if (ndim > 8) throw std::runtime_error(path + ": implausible rank");
    Shape dims(ndim);
    // Every size is checked against the bytes that are left before any
    // memory is allocated: a corrupt or hostile file must not make the
    // agent allocate what its shape claims.
    // `span` ignores zero dimensions, so that {0, 2^62, 2^62} (no bytes,
    // but strides that overflow) is refused too.
    uint64_t expected = dtype_size(static_cast<DType>(dt)), span = expected;
    for (auto& d : dims) {
      d = r.get<int64_t>("dimension");
      const uint64_t u = static_cast<uint64_t>(d);
      if (d < 0 || __builtin_mul_overflow(expected, u, &expected) ||
          __builtin_mul_overflow(span, std::max<uint64_t>(u, 1), &span) ||
          span > static_cast<uint64_t>(INT64_MAX)) {
        throw std::runtime_error(path + ": tensor '" + printable(name) +
                                 "' has a negative or overflowing dimension");
      }
    }
    uint64_t nbytes = r.get<uint64_t>("size");
    if (nbytes != expected) {
      throw std::runtime_error(path + ": size of '" + printable(name) +
                               "' does not match its shape");
    }
    if (nbytes > r.left()) {
      throw std::runtime_error(path + " is truncated (tensor '" + printable(name) + "' claims " +
                               std::to_string(nbytes) + " bytes, " + std::to_string(r.left()) +
                               " are left)");
    }
    Tensor t = empty(dims, {static_cast<DType>(dt)});
    r.bytes(t.raw_data(), nbytes, "tensor data");
    out.emplace_back(name, t);
  }
  return out;
}

void restore(const nn::NamedTensors& loaded, const nn::NamedTensors& targets) {
  std::map<std::string, Tensor> by_name(loaded.begin(), loaded.end());
  for (const auto& [name, t] : targets) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw std::invalid_argument("checkpoint lacks '" + name + "'");
    if (it->second.sizes() != t.sizes() || it->second.dtype() != t.dtype()) {
      throw std::invalid_argument("checkpoint '" + name + "' is " + it->second.shape_str() + " " +
                                  dtype_name(it->second.dtype()) + ", expected " + t.shape_str() +
                                  " " + dtype_name(t.dtype()));
    }
  }
  NoGradGuard no_grad;
  for (const auto& [name, t] : targets) {
    Tensor target = t.detach();
    target.copy_(by_name[name]);
  }
}

}  // namespace leasehold::engine::checkpoint
