// File format (little-endian):
//   magic "LHCKPT\r\n" (8 bytes) | version u32 | count u32
//   count × { name_len u32 | name | dtype u8 | ndim u32 | dims i64 × ndim |
//             nbytes u64 | data }
//   crc32 u32 of everything after the magic, up to here
#include "agent/engine/checkpoint.h"

#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>

#include "agent/engine/autograd.h"

namespace leasehold::engine::checkpoint {
namespace {

template <class T>
void put(std::string& out, T v) {
  out.append(reinterpret_cast<const char*>(&v), sizeof v);
}

class Reader {
 public:
  Reader(const std::string& data, const std::string& path) : d_(data), path_(path) {}
  template <class T>
  T get(const char* what) {
    T v;
    bytes(&v, sizeof v, what);
    return v;
  }
  void bytes(void* dst, size_t n, const char* what) {
    if (pos_ + n > d_.size()) {
      throw std::runtime_error(path_ + " is truncated (reading " + what + ")");
    }
    std::memcpy(dst, d_.data() + pos_, n);
    pos_ += n;
  }
  size_t pos() const { return pos_; }

 private:
  const std::string& d_;
  std::string path_;
  size_t pos_ = 0;
};

void write_all(int fd, const std::string& data, const std::string& path) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t w = ::write(fd, data.data() + done, data.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      throw std::runtime_error("cannot write " + path + ": " + std::strerror(errno));
    }
    done += static_cast<size_t>(w);
  }
}

}  // namespace

void save(const std::string& path, const nn::NamedTensors& tensors) {
  std::string body;
  put<uint32_t>(body, kVersion);
  put<uint32_t>(body, static_cast<uint32_t>(tensors.size()));
  for (const auto& [name, t] : tensors) {
    Tensor host = t.detach().to(Device::cpu()).contiguous();
    put<uint32_t>(body, static_cast<uint32_t>(name.size()));
    body += name;
    put<uint8_t>(body, static_cast<uint8_t>(host.dtype()));
    put<uint32_t>(body, static_cast<uint32_t>(host.dim()));
    for (int64_t d : host.sizes()) put<int64_t>(body, d);
    uint64_t nbytes = host.numel() * dtype_size(host.dtype());
    put<uint64_t>(body, nbytes);
    body.append(static_cast<const char*>(host.raw_data()), nbytes);
  }
  uint32_t crc = crc32(0L, reinterpret_cast<const Bytef*>(body.data()), body.size());
  put<uint32_t>(body, crc);

  std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw std::runtime_error("cannot create " + tmp + ": " + std::strerror(errno));
  try {
    write_all(fd, std::string(kMagic, sizeof kMagic) + body, tmp);
    if (::fsync(fd) != 0) throw std::runtime_error("fsync " + tmp + ": " + std::strerror(errno));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    throw std::runtime_error("cannot rename " + tmp + " to " + path + ": " + std::strerror(err));
  }
  // Make the rename itself durable.
  std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

nn::NamedTensors load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open checkpoint " + path);
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (data.size() < sizeof kMagic + 12 || std::memcmp(data.data(), kMagic, sizeof kMagic) != 0) {
    throw std::runtime_error(path + " is not a Leasehold checkpoint (bad magic)");
  }
  std::string body = data.substr(sizeof kMagic);
  uint32_t stored_crc;
  std::memcpy(&stored_crc, body.data() + body.size() - 4, 4);
  body.resize(body.size() - 4);
  if (crc32(0L, reinterpret_cast<const Bytef*>(body.data()), body.size()) != stored_crc) {
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
    if (dt > static_cast<uint8_t>(DType::Int64)) throw std::runtime_error(path + ": bad dtype");
    uint32_t ndim = r.get<uint32_t>("rank");
    if (ndim > 8) throw std::runtime_error(path + ": implausible rank");
    Shape dims(ndim);
    for (auto& d : dims) d = r.get<int64_t>("dimension");
    uint64_t nbytes = r.get<uint64_t>("size");
    Tensor t = empty(dims, {static_cast<DType>(dt)});
    if (nbytes != static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype())) {
      throw std::runtime_error(path + ": size of '" + name + "' does not match its shape");
    }
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
      throw std::invalid_argument("checkpoint '" + name + "' is " + it->second.shape_str() +
                                  " " + dtype_name(it->second.dtype()) + ", expected " +
                                  t.shape_str() + " " + dtype_name(t.dtype()));
    }
  }
  NoGradGuard no_grad;
  for (const auto& [name, t] : targets) {
    Tensor target = t.detach();
    target.copy_(by_name[name]);
  }
}

}  // namespace leasehold::engine::checkpoint
