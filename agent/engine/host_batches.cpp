#include "agent/engine/host_batches.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>

#include "agent/engine/cuda_context.h"
#include "agent/engine/data.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "shared/cuda_check.h"
#endif

namespace leasehold::engine::data {

#ifdef LEASEHOLD_HAVE_CUDA
// One pinned buffer. Free: the loader may fill it (after its event, if a
// copy read it). Ready: holds batch `index` of epoch `epoch`.
struct HostBatches::Slot {
  enum class State { Free, Filling, Ready } state = State::Free;
  float* images = nullptr;
  int64_t* labels = nullptr;
  int64_t rows = 0;
  int64_t index = 0;
  uint64_t epoch = 0;
  cudaEvent_t copied = nullptr;  // recorded after the copies that read it
  bool in_flight = false;        // `copied` was recorded and not yet waited for
};

HostBatches::HostBatches(const Dataset& data, int64_t batch, Device device, int slots)
    : data_(data),
      batch_(batch),
      row_floats_(data.images.numel() / std::max<int64_t>(data.images.sizes()[0], 1)),
      device_(device) {
  if (!device.is_cuda()) throw std::invalid_argument("HostBatches: the device must be CUDA");
  if (batch <= 0 || slots < 1) throw std::invalid_argument("HostBatches: bad batch or slots");
  if (data.images.dtype() != DType::Float32 || data.labels.dtype() != DType::Int64) {
    throw std::invalid_argument("HostBatches: float32 images and int64 labels expected");
  }
  try {
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(device.index));
    for (int i = 0; i < slots; ++i) {
      slots_.push_back(std::make_unique<Slot>());
      Slot& s = *slots_.back();
      LEASEHOLD_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.images),
                                         sizeof(float) * batch * row_floats_,
                                         cudaHostAllocDefault));
      LEASEHOLD_CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&s.labels),
                                         sizeof(int64_t) * batch, cudaHostAllocDefault));
      LEASEHOLD_CUDA_CHECK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming));
    }
    loader_ = std::thread([this] { load_loop(); });
  } catch (...) {
    release_slots();
    throw;
  }
}

void HostBatches::release_slots() {
  for (auto& s : slots_) {
    // A copy still queued reads this buffer; errors (a lost context) only
    // mean nothing runs any more.
    if (s->in_flight) (void)cudaEventSynchronize(s->copied);
    if (s->copied) (void)cudaEventDestroy(s->copied);
    if (s->images) (void)cudaFreeHost(s->images);
    if (s->labels) (void)cudaFreeHost(s->labels);
  }
  slots_.clear();
}

HostBatches::~HostBatches() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  loader_.join();
  release_slots();
}

void HostBatches::start_epoch(const std::vector<int64_t>& order) {
  {
    std::lock_guard lock(mu_);
    order_ = order;
    ++epoch_;
    loaded_ = 0;
    taken_ = 0;
    for (auto& s : slots_) {
      if (s->state == Slot::State::Ready) s->state = Slot::State::Free;  // the old epoch's
    }
  }
  cv_.notify_all();
}

void HostBatches::load_loop() {
  try {
    load_batches();
  } catch (...) {
    // Handed to the training thread, which rethrows it from next().
    std::lock_guard lock(mu_);
    error_ = std::current_exception();
    cv_.notify_all();
  }
}

void HostBatches::load_batches() {
  (void)cudaSetDevice(device_.index);
  const int64_t total = static_cast<int64_t>(data_.images.sizes()[0]);
  const float* src = data_.images.data<float>();
  const int64_t* lab = data_.labels.data<int64_t>();
  std::unique_lock lock(mu_);
  while (true) {
    Slot* slot = nullptr;
    cv_.wait(lock, [&] {
      if (stop_) return true;
      const int64_t batches = (static_cast<int64_t>(order_.size()) + batch_ - 1) / batch_;
      if (loaded_ >= batches) return false;
      for (auto& s : slots_) {
        if (s->state == Slot::State::Free) {
          slot = s.get();
          return true;
        }
      }
      return false;
    });
    if (stop_) return;
    const uint64_t epoch = epoch_;
    const int64_t index = loaded_++;
    const int64_t first = index * batch_;
    const int64_t rows = std::min<int64_t>(batch_, static_cast<int64_t>(order_.size()) - first);
    std::vector<int64_t> picks(order_.begin() + first, order_.begin() + first + rows);
    slot->state = Slot::State::Filling;
    const bool wait_copy = slot->in_flight;
    lock.unlock();
    // The previous copy out of this buffer must have finished (this thread
    // waits, not the training thread).
    if (wait_copy) (void)cudaEventSynchronize(slot->copied);
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t k = picks[i];
      if (k < 0 || k >= total) continue;  // the iterator builds the order; never out of range
      std::memcpy(slot->images + i * row_floats_, src + k * row_floats_,
                  sizeof(float) * row_floats_);
      slot->labels[i] = lab[k];
    }
    lock.lock();
    slot->in_flight = false;
    slot->rows = rows;
    slot->index = index;
    slot->epoch = epoch;
    // A batch of an epoch that has been replaced meanwhile is dropped.
    slot->state = epoch == epoch_ ? Slot::State::Ready : Slot::State::Free;
    cv_.notify_all();
  }
}

bool HostBatches::next(Tensor& images, Tensor& labels) {
  std::unique_lock lock(mu_);
  const int64_t batches = (static_cast<int64_t>(order_.size()) + batch_ - 1) / batch_;
  if (taken_ >= batches) return false;
  Slot* slot = nullptr;
  cv_.wait(lock, [&] {
    if (error_) return true;
    for (auto& s : slots_) {
      if (s->state == Slot::State::Ready && s->epoch == epoch_ && s->index == taken_) {
        slot = s.get();
        return true;
      }
    }
    return false;
  });
  if (error_) std::rethrow_exception(error_);
  ++taken_;
  const int64_t rows = slot->rows;
  lock.unlock();
  Shape shape = data_.images.sizes();
  shape[0] = rows;
  images = empty(shape, TensorOptions{}.with(DType::Float32).on(device_));
  labels = empty({rows}, TensorOptions{}.with(DType::Int64).on(device_));
  cudaStream_t stream = compute_stream(device_.index);
  LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(images.raw_data(), slot->images,
                                       sizeof(float) * rows * row_floats_,
                                       cudaMemcpyHostToDevice, stream));
  LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(labels.raw_data(), slot->labels, sizeof(int64_t) * rows,
                                       cudaMemcpyHostToDevice, stream));
  LEASEHOLD_CUDA_CHECK(cudaEventRecord(slot->copied, stream));
  lock.lock();
  slot->in_flight = true;
  slot->state = Slot::State::Free;
  lock.unlock();
  cv_.notify_all();
  return true;
}

#else  // no CUDA: never constructed (the iterator only uses it for a CUDA device)

struct HostBatches::Slot {};
HostBatches::HostBatches(const Dataset& data, int64_t batch, Device device, int)
    : data_(data), batch_(batch), row_floats_(0), device_(device) {
  throw std::logic_error("HostBatches: a CUDA device in a build without CUDA");
}
HostBatches::~HostBatches() = default;
void HostBatches::start_epoch(const std::vector<int64_t>&) {}
bool HostBatches::next(Tensor&, Tensor&) { return false; }
void HostBatches::load_loop() {}
void HostBatches::load_batches() {}
void HostBatches::release_slots() {}

#endif

}  // namespace leasehold::engine::data
