#include "agent/engine/data.h"

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>

namespace leasehold::engine::data {
namespace {

// gzread reads plain files as well as gzip ones.
class GzFile {
 public:
  explicit GzFile(const std::string& path) : path_(path), f_(gzopen(path.c_str(), "rb")) {
    if (!f_) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  }
  ~GzFile() { gzclose(f_); }
  // Reads exactly n bytes; throws naming `what` when the file ends first.
  void read(void* dst, size_t n, const char* what) {
    size_t done = 0;
    while (done < n) {
      unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
      int r = gzread(f_, static_cast<char*>(dst) + done, chunk);
      if (r < 0) {
        int err = 0;
        throw std::runtime_error(path_ + ": read error: " + gzerror(f_, &err));
      }
      if (r == 0) {
        throw std::runtime_error(path_ + " is truncated: expected " + std::to_string(n) +
                                 " bytes of " + what + ", got " + std::to_string(done));
      }
      done += static_cast<size_t>(r);
    }
  }

 private:
  std::string path_;
  gzFile f_;
};

uint32_t big_endian(const uint8_t* p) {
  return (uint32_t(p[0]) << 24) | (uint32_t(p[1]) << 16) | (uint32_t(p[2]) << 8) | p[3];
}

}  // namespace

namespace {
std::vector<int64_t> read_header(GzFile& f, const std::string& path) {
  uint8_t magic[4];
  f.read(magic, 4, "header");
  if (magic[0] != 0 || magic[1] != 0) {
    throw std::runtime_error(path + " is not an IDX file (magic bytes " +
                             std::to_string(magic[0]) + " " + std::to_string(magic[1]) +
                             ", expected 0 0)");
  }
  if (magic[2] != 0x08) {
    throw std::runtime_error(path + ": IDX element type " + std::to_string(magic[2]) +
                             " is not supported (only unsigned bytes, 0x08)");
  }
  int ndims = magic[3];
  if (ndims < 1 || ndims > 4) {
    throw std::runtime_error(path + ": IDX file with " + std::to_string(ndims) + " dimensions");
  }
  std::vector<int64_t> dims;
  size_t total = 1;
  for (int i = 0; i < ndims; ++i) {
    uint8_t b[4];
    f.read(b, 4, "dimensions");
    uint32_t d = big_endian(b);
    if (d == 0 || d > (1u << 28)) {
      throw std::runtime_error(path + ": implausible dimension " + std::to_string(d));
    }
    dims.push_back(d);
    total *= d;
    if (total > (size_t(1) << 34)) throw std::runtime_error(path + ": IDX body too large");
  }
  return dims;
}
}  // namespace

std::vector<int64_t> read_idx_dims(const std::string& path) {
  GzFile f(path);
  return read_header(f, path);
}

IdxArray read_idx(const std::string& path) {
  GzFile f(path);
  IdxArray out;
  out.dims = read_header(f, path);
  size_t total = 1;
  for (int64_t d : out.dims) total *= static_cast<size_t>(d);
  out.bytes.resize(total);
  f.read(out.bytes.data(), total, "data");
  return out;
}

Dataset load_idx_dataset(const std::string& images_path, const std::string& labels_path,
                         double mean, double std, int64_t limit) {
  if (!(std > 0)) throw std::invalid_argument("dataset normalisation std must be positive");
  IdxArray img = read_idx(images_path);
  IdxArray lab = read_idx(labels_path);
  if (img.dims.size() != 3) {
    throw std::runtime_error(images_path + ": expected [N, H, W] images, got " +
                             std::to_string(img.dims.size()) + " dimensions");
  }
  if (lab.dims.size() != 1) throw std::runtime_error(labels_path + ": expected [N] labels");
  if (img.dims[0] != lab.dims[0]) {
    throw std::runtime_error(images_path + " holds " + std::to_string(img.dims[0]) +
                             " images but " + labels_path + " holds " +
                             std::to_string(lab.dims[0]) + " labels");
  }
  int64_t n = img.dims[0], h = img.dims[1], w = img.dims[2];
  if (limit > 0) n = std::min(n, limit);
  std::vector<float> pixels(n * h * w);
  for (size_t i = 0; i < pixels.size(); ++i) {
    pixels[i] = static_cast<float>((img.bytes[i] / 255.0 - mean) / std);
  }
  std::vector<int64_t> labels(lab.bytes.begin(), lab.bytes.begin() + n);
  Dataset d;
  d.images = from_vector(pixels, {n, 1, h, w});
  d.labels = from_vector(labels, {n});
  return d;
}

BatchIterator::BatchIterator(const Dataset& data, int64_t batch_size, bool shuffle,
                             uint64_t seed)
    : data_(data), batch_(batch_size), shuffle_(shuffle), seed_(seed) {
  if (batch_size <= 0) throw std::invalid_argument("batch size must be positive");
  order_.resize(data.size());
  start_epoch(0);
}

void BatchIterator::start_epoch(int64_t epoch) {
  std::iota(order_.begin(), order_.end(), 0);
  if (shuffle_) {
    std::mt19937_64 rng(seed_ * 1000003ULL + static_cast<uint64_t>(epoch));
    std::shuffle(order_.begin(), order_.end(), rng);
  }
  pos_ = 0;
}

int64_t BatchIterator::batches_per_epoch() const {
  return (data_.size() + batch_ - 1) / batch_;
}

bool BatchIterator::next(Tensor& images, Tensor& labels, Device device) {
  int64_t n = std::min<int64_t>(batch_, data_.size() - pos_);
  if (n <= 0) return false;
  const Shape& s = data_.images.sizes();
  int64_t per = numel_of(s) / s[0];
  std::vector<float> x(n * per);
  std::vector<int64_t> y(n);
  const float* src = data_.images.data<float>();
  const int64_t* lab = data_.labels.data<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    int64_t k = order_[pos_ + i];
    std::copy(src + k * per, src + (k + 1) * per, x.begin() + i * per);
    y[i] = lab[k];
  }
  pos_ += n;
  Shape shape = s;
  shape[0] = n;
  images = from_vector(x, shape, device);
  labels = from_vector(y, {n}, device);
  return true;
}

}  // namespace leasehold::engine::data
