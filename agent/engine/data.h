// IDX datasets (MNIST, Fashion-MNIST), gzipped or not, and shuffled
// mini-batches. Debian's dataset-fashion-mnist package installs the files
// under /usr/share/datasets/fashion-mnist/.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <memory>
#include <vector>

#include "agent/engine/tensor.h"

namespace leasehold::engine::data {

// Reads an IDX file of unsigned bytes (type 0x08). Returns its dimensions
// and bytes. Throws std::runtime_error naming the file for a missing file, a
// wrong magic number or element type, or a truncated body (see
// shared/idx_file.h, which also reads only the dimensions).
struct IdxArray {
  std::vector<int64_t> dims;
  std::vector<uint8_t> bytes;
};
IdxArray read_idx(const std::string& path);

// Images [N, 1, H, W] float32, scaled to [0, 1] then (x - mean) / std, and
// labels [N] int64. Throws when the counts of the two files differ. A text
// dataset is a corpus instead (see text_windows).
struct Dataset {
  Dataset() = default;
  Dataset(Tensor images_, Tensor labels_)
      : images(std::move(images_)), labels(std::move(labels_)) {}

  Tensor images;
  Tensor labels;
  // A text corpus: its bytes, eight to an int64 element (the engine has no
  // byte type), `text_bytes` of them. Sample i is the `context` bytes from
  // i × context as int64 tokens, and each one's successor as its label
  // (BatchIterator makes them as it gathers a batch): a byte of memory a
  // token, where the samples as int64 tensors would take sixteen.
  Tensor text;
  int64_t text_bytes = 0, context = 0;

  bool is_text() const { return text.defined(); }
  int64_t size() const {
    if (is_text()) return text_bytes > context ? (text_bytes - 1) / context : 0;
    return labels.defined() ? labels.size(0) : 0;
  }
  Device device() const { return is_text() ? text.device() : images.device(); }
  // The same samples on `device` (itself where they are).
  Dataset to(Device device) const;
};
Dataset load_idx_dataset(const std::string& images_path, const std::string& labels_path,
                         double mean, double std, int64_t limit = 0);

// Files read as bytes, one after the other. Throws std::runtime_error
// naming a file that cannot be opened or read whole.
std::vector<uint8_t> read_text_files(const std::vector<std::string>& paths);

// Next-token samples of a byte sequence: windows of context + 1 bytes at a
// stride of `context` (each byte is a target once per epoch), batched as
// int64 [N, context] tokens and int64 [N, context] successors. The corpus
// is held as its bytes (Dataset::text), on the CPU. Fewer than context + 1
// bytes make no sample.
Dataset text_windows(const uint8_t* bytes, int64_t count, int64_t context);

// The normalised value of each pixel byte: (b / 255 - mean) / std, in
// double, rounded to float (what load_idx_dataset stores).
struct PixelTable {
  PixelTable(double mean, double std);
  float value[256];
};

// Shuffled mini-batches, reshuffled each epoch from `seed` and the epoch
// number (reproducible). The last batch may be smaller. Where the dataset
// already is on the batches' device (resident in a shared cache region) a
// batch is gathered there (take_rows; the epoch's order goes to the device
// once per epoch) or, unshuffled, is a view of it: no host work and no copy
// per batch. A dataset in host memory goes to a CUDA device through pinned
// buffers a loader thread fills ahead (agent/engine/host_batches.h: no
// host wait per batch); to the CPU it is gathered directly (one on another
// device is gathered there and moved). A text corpus's batches are
// gathered from its bytes where it is (take_byte_windows), shuffled or not.
// All give the same batches.
// REQUIRES: images and labels on one device.
class HostBatches;
class BatchIterator {
 public:
  BatchIterator(const Dataset& data, int64_t batch_size, bool shuffle, uint64_t seed);
  ~BatchIterator();
  // Makes this the iterator of replica `rank` of `world` data-parallel
  // replicas: each step of the epoch takes the next global batch of
  // batch_size × world samples of the epoch's order (the order one
  // iterator with the same seed has) and yields this replica's slice of it,
  // batch_size samples; a last global batch that is not whole is left out,
  // so every replica takes the same number of steps. Call before the first
  // epoch.
  void shard(int rank, int world);
  // Starts epoch `epoch` (0-based).
  void start_epoch(int64_t epoch);
  // Next batch on `device`; false at the end of the epoch. `into`: where
  // images and labels come defined, contiguous, on the device, not
  // requiring grad and of the batch's shape and dtypes (a CUDA graph's
  // inputs, which nothing else reads), a batch gathered from a dataset
  // resident there is written into them. Else (and always without `into`)
  // they are replaced.
  bool next(Tensor& images, Tensor& labels, Device device, bool into = false);
  int64_t batches_per_epoch() const;

 private:
  // next() for a text corpus: `n` samples' windows.
  void next_text(Tensor& tokens, Tensor& successors, Device device, bool into, int64_t n);
  const Dataset& data_;
  int64_t batch_;
  bool shuffle_;
  uint64_t seed_;
  int rank_ = 0, world_ = 1;
  bool started_ = false;
  std::vector<int64_t> order_;  // this replica's samples of the epoch, in order
  Tensor device_order_;  // order_ on the dataset's device, for this epoch
  int64_t pos_ = 0;
  std::unique_ptr<HostBatches> host_batches_;  // host dataset, CUDA batches
};

}  // namespace leasehold::engine::data
