#include "agent/engine/data.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>

#include "agent/engine/host_batches.h"
#include "agent/engine/ops.h"
#include "shared/idx_file.h"

namespace leasehold::engine::data {

std::vector<uint8_t> read_text_files(const std::vector<std::string>& paths) {
  std::vector<uint8_t> out;
  for (const std::string& path : paths) {
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> f(std::fopen(path.c_str(), "rb"), &std::fclose);
    if (!f) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
    uint8_t buf[1 << 16];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f.get())) > 0) out.insert(out.end(), buf, buf + n);
    if (std::ferror(f.get())) throw std::runtime_error(path + ": read failed");
  }
  return out;
}

Dataset text_windows(const uint8_t* bytes, int64_t count, int64_t context) {
  if (context < 1) throw std::invalid_argument("text_windows: context must be positive");
  if (count < 0) throw std::invalid_argument("text_windows: a negative byte count");
  std::vector<int64_t> words(static_cast<size_t>((count + 7) / 8), 0);
  if (count > 0) std::memcpy(words.data(), bytes, static_cast<size_t>(count));
  Dataset d;
  d.text = from_vector(words, {static_cast<int64_t>(words.size())});
  d.text_bytes = count;
  d.context = context;
  return d;
}

Dataset Dataset::to(Device device) const {
  Dataset d = *this;
  if (is_text()) {
    d.text = text.to(device);
  } else {
    if (images.defined()) d.images = images.to(device);
    if (labels.defined()) d.labels = labels.to(device);
  }
  return d;
}

IdxArray read_idx(const std::string& path) {
  IdxFile f(path);
  IdxArray out;
  out.dims = f.dims();
  out.bytes.resize(f.body_bytes());
  f.read_body(out.bytes.data());
  return out;
}

PixelTable::PixelTable(double mean, double std) {
  for (int b = 0; b < 256; ++b) value[b] = static_cast<float>((b / 255.0 - mean) / std);
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
  // Every pixel value's normalised float, computed once and looked up: two
  // double divisions per pixel were most of the time.
  const PixelTable table(mean, std);
  Dataset d;
  d.images = empty({n, 1, h, w});
  float* pixels = d.images.data<float>();
  const uint8_t* bytes = img.bytes.data();
  for (int64_t i = 0, count = n * h * w; i < count; ++i) pixels[i] = table.value[bytes[i]];
  d.labels = empty({n}, {DType::Int64});
  std::copy(lab.bytes.begin(), lab.bytes.begin() + n, d.labels.data<int64_t>());
  return d;
}

BatchIterator::BatchIterator(const Dataset& data, int64_t batch_size, bool shuffle,
                             uint64_t seed)
    : data_(data), batch_(batch_size), shuffle_(shuffle), seed_(seed) {
  if (batch_size <= 0) throw std::invalid_argument("batch size must be positive");
  // Epoch 0 is shuffled on the first next() unless start_epoch() comes first.
}

BatchIterator::~BatchIterator() = default;

void BatchIterator::shard(int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world) {
    throw std::invalid_argument("replica " + std::to_string(rank) + " of " +
                                std::to_string(world) + " is not a replica");
  }
  if (data_.size() < batch_ * world) {
    throw std::invalid_argument(
        "the dataset's " + std::to_string(data_.size()) + " samples are fewer than one global "
        "batch (batch_size " + std::to_string(batch_) + " × " + std::to_string(world) +
        " replicas)");
  }
  rank_ = rank;
  world_ = world;
  started_ = false;
}

void BatchIterator::start_epoch(int64_t epoch) {
  order_.resize(data_.size());
  std::iota(order_.begin(), order_.end(), 0);
  if (shuffle_) {
    std::mt19937_64 rng(seed_ * 1000003ULL + static_cast<uint64_t>(epoch));
    std::shuffle(order_.begin(), order_.end(), rng);
  }
  if (world_ > 1) {
    // This replica's slice of each whole global batch, in step order.
    const int64_t global = batch_ * world_;
    const int64_t steps = data_.size() / global;
    std::vector<int64_t> mine;
    mine.reserve(static_cast<size_t>(steps * batch_));
    for (int64_t g = 0; g < steps; ++g) {
      auto first = order_.begin() + g * global + rank_ * batch_;
      mine.insert(mine.end(), first, first + batch_);
    }
    order_ = std::move(mine);
  }
  started_ = true;
  device_order_ = Tensor();
  pos_ = 0;
  if (host_batches_) host_batches_->start_epoch(order_);
}

int64_t BatchIterator::batches_per_epoch() const {
  if (world_ > 1) return data_.size() / (batch_ * world_);
  return (data_.size() + batch_ - 1) / batch_;
}

void BatchIterator::next_text(Tensor& tokens, Tensor& successors, Device device, bool into,
                              int64_t n) {
  const Device home = data_.device();
  const int64_t samples = static_cast<int64_t>(order_.size());
  if (!device_order_.defined()) device_order_ = from_vector(order_, {samples}, home);
  const Tensor index = device_order_.narrow(0, pos_, n);
  // Into the caller's tensors where they fit (no copy after).
  const auto fits = [&](const Tensor& out) {
    return into && out.defined() && home == device && !out.requires_grad() &&
           out.is_contiguous() && out.dtype() == DType::Int64 && out.device() == home &&
           out.dim() == 2 && out.size(0) == n && out.size(1) == data_.context;
  };
  if (!fits(tokens) || !fits(successors)) {
    tokens = empty({n, data_.context}, {DType::Int64, home});
    successors = empty({n, data_.context}, {DType::Int64, home});
  }
  // (A sample's successors are its window one byte on.)
  take_byte_windows_into(tokens, data_.text, data_.text_bytes, index, data_.context, 0);
  take_byte_windows_into(successors, data_.text, data_.text_bytes, index, data_.context, 1);
  if (home != device) {
    tokens = tokens.to(device);
    successors = successors.to(device);
  }
  pos_ += n;
}

bool BatchIterator::next(Tensor& images, Tensor& labels, Device device, bool into) {
  if (!started_) start_epoch(0);
  const int64_t samples = static_cast<int64_t>(order_.size());
  int64_t n = std::min<int64_t>(batch_, samples - pos_);
  if (n <= 0) return false;
  const Device home = data_.device();
  if (data_.is_text()) {
    next_text(images, labels, device, into, n);
    return true;
  }
  if (home != Device::cpu() || home == device) {
    // Resident where the batches go (or on another device: gathered there,
    // then moved).
    if (!shuffle_ && world_ == 1) {
      images = data_.images.narrow(0, pos_, n);
      labels = data_.labels.narrow(0, pos_, n);
    } else {
      if (!device_order_.defined()) device_order_ = from_vector(order_, {samples}, home);
      Tensor index = device_order_.narrow(0, pos_, n);
      // Into the caller's tensors where they fit (no copy after).
      const auto fits = [&](const Tensor& out, const Tensor& from) {
        if (!into || !out.defined() || home != device || out.requires_grad() ||
            !out.is_contiguous() ||
            out.dtype() != from.dtype() || out.device() != home || out.dim() != from.dim() ||
            out.size(0) != n) {
          return false;
        }
        for (int64_t d = 1; d < from.dim(); ++d) {
          if (out.size(d) != from.size(d)) return false;
        }
        return true;
      };
      if (fits(images, data_.images) && fits(labels, data_.labels)) {
        take_rows_into(images, data_.images, index);
        take_rows_into(labels, data_.labels, index);
      } else {
        images = take_rows(data_.images, index);
        labels = take_rows(data_.labels, index);
      }
    }
    if (home != device) {
      images = images.to(device);
      labels = labels.to(device);
    }
    pos_ += n;
    return true;
  }
  if (device.is_cuda() && (host_batches_ || pos_ == 0)) {
    if (!host_batches_) {
      host_batches_ = std::make_unique<HostBatches>(data_, batch_, device);
      host_batches_->start_epoch(order_);
    }
    if (!host_batches_->next(images, labels)) return false;
    pos_ += n;
    return true;
  }
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
