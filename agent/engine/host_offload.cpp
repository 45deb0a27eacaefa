#include "agent/engine/host_offload.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/cuda_context.h"
#include "shared/units.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "shared/cuda_check.h"
#endif

namespace leasehold::engine {

struct OffloadSlot::State {
  std::shared_ptr<Storage> host;  // page-locked for CUDA tensors
  bool pinned = false;            // `host` is page-locked
  bool claimed = false;           // a live handle's tensor is in `host`
  bool warned = false;            // host memory was short once (logged)
#ifdef LEASEHOLD_HAVE_CUDA
  int device = -1;  // of the events
  // ready: the compute stream's point a copy waits for; out_done, in_done:
  // the copy stream's copies, which the compute stream waits for.
  cudaEvent_t ready = nullptr, out_done = nullptr, in_done = nullptr;
  // Events on device `d`, made again when the slot moved to another
  // (called only while no handle claims the slot: no copy waits on them).
  void make_events(int d) {
    if (device == d) return;
    destroy_events();
    LEASEHOLD_CUDA_CHECK(cudaSetDevice(d));
    for (cudaEvent_t* e : {&ready, &out_done, &in_done}) {
      LEASEHOLD_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming));
    }
    device = d;
  }
  void destroy_events() {
    for (cudaEvent_t* e : {&ready, &out_done, &in_done}) {
      if (*e) cudaEventDestroy(*e);
      *e = nullptr;
    }
    device = -1;
  }
  ~State() { destroy_events(); }
#endif
};

namespace {

// This thread's stashed tensors, in the order they were stashed (backward
// wants them in the reverse), and the count of blocks forward went past.
struct Queue {
  std::vector<std::weak_ptr<OffloadedTensor>> stashed;
  uint64_t progress = 0;
  void prune() {
    stashed.erase(
        std::remove_if(stashed.begin(), stashed.end(), [](const auto& w) { return w.expired(); }),
        stashed.end());
  }
};
thread_local Queue t_queue;

#ifdef LEASEHOLD_HAVE_CUDA
// Copies `bytes` from `from` to `to` on `device`'s copy stream, after the
// work `stream` queued so far (`ready` marks that point), and records
// `done` after the copy.
void copy_after(cudaStream_t stream, cudaEvent_t ready, cudaEvent_t done, int device, void* to,
                const void* from, uint64_t bytes, cudaMemcpyKind kind) {
  cudaStream_t copy = copy_stream(device);
  LEASEHOLD_CUDA_CHECK(cudaEventRecord(ready, stream));
  LEASEHOLD_CUDA_CHECK(cudaStreamWaitEvent(copy, ready, 0));
  // (A step traced only has no bytes to copy: cuda_context.h.)
  if (!tracing_step()) LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(to, from, bytes, kind, copy));
  LEASEHOLD_CUDA_CHECK(cudaEventRecord(done, copy));
}
#endif

}  // namespace

OffloadSlot::OffloadSlot() : state_(std::make_shared<State>()) {}
OffloadSlot::~OffloadSlot() = default;

uint64_t OffloadSlot::host_bytes() const { return state_->host ? state_->host->bytes() : 0; }

bool OffloadSlot::short_of_memory() const { return state_->warned; }

std::shared_ptr<OffloadedTensor> OffloadSlot::stash(const Tensor& x) {
  std::shared_ptr<OffloadedTensor> h(new OffloadedTensor);
  h->slot_ = state_;
  h->sizes_ = x.sizes();
  h->options_ = x.options();
  h->bytes_ = static_cast<uint64_t>(x.numel()) * dtype_size(x.dtype());
  h->device_ = x.detach();  // (not its graph)
  // (Kept on the device: the slot is another's yet, or nothing to move.)
  if (state_->claimed || !x.is_contiguous() || h->bytes_ == 0) return h;

  const Device device = x.device();
  if (!state_->host || state_->host->bytes() < h->bytes_ || state_->pinned != device.is_cuda()) {
    // (Grows only: a smaller tensor, the epoch's last batch, fits the same.)
#ifdef LEASEHOLD_HAVE_CUDA
    auto alloc = device.is_cuda() ? pinned_host_allocator() : cpu_allocator();
#else
    auto alloc = cpu_allocator();
#endif
    try {
      state_->host = std::make_shared<Storage>(h->bytes_, std::move(alloc));
    } catch (const OutOfMemoryError& e) {
      // (Host memory short: the tensor stays where it is, as without a
      // slot, rather than failing a step for what the device can hold.)
      if (!state_->warned) {
        spdlog::warn("a kept tensor of {} stays on the device: {}", format_bytes(h->bytes_),
                     e.what());
        state_->warned = true;
      }
      return h;
    }
    state_->pinned = device.is_cuda();
  }
  state_->claimed = true;
  h->offloaded_ = true;
  h->stashed_at_ = t_queue.progress;
  if (device.is_cuda()) {
#ifdef LEASEHOLD_HAVE_CUDA
    state_->make_events(device.index);
    cudaStream_t stream = compute_stream(device.index);
    h->stream_ = stream;
    copy_after(stream, state_->ready, state_->out_done, device.index, state_->host->data(),
               x.raw_data(), h->bytes_, cudaMemcpyDeviceToHost);
    h->where_ = OffloadedTensor::Where::CopyingOut;
#endif
  } else {
    // (Copied at once; the tensor's own memory is let go on the schedule
    // a device's copy out would have, so that the bookkeeping is the same.)
    std::memcpy(state_->host->data(), x.raw_data(), h->bytes_);
    h->where_ = OffloadedTensor::Where::CopyingOut;
  }
  t_queue.prune();
  t_queue.stashed.push_back(h);
  return h;
}

void OffloadedTensor::fetch() {
  device_ = empty(sizes_, options_);
  if (options_.device.is_cuda()) {
#ifdef LEASEHOLD_HAVE_CUDA
    copy_after(static_cast<cudaStream_t>(stream_), slot_->ready, slot_->in_done,
               options_.device.index, device_.raw_data(), slot_->host->data(), bytes_,
               cudaMemcpyHostToDevice);
#endif
  } else {
    std::memcpy(device_.raw_data(), slot_->host->data(), bytes_);
  }
  where_ = Where::CopyingIn;
}

Tensor OffloadedTensor::get() {
  Tensor out;
  switch (where_) {
    case Where::Kept:
    case Where::CopyingOut:
      // (Still on the device: read in place, beside the copy out reading it
      // too. The handle lets it go when it goes.)
      out = device_;
      read_in_place_ = true;
      break;
    case Where::OnHost:
    case Where::HandedOut:
      fetch();
      [[fallthrough]];
    case Where::CopyingIn:
#ifdef LEASEHOLD_HAVE_CUDA
      if (stream_) {
        LEASEHOLD_CUDA_CHECK(
            cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), slot_->in_done, 0));
      }
#endif
      out = std::move(device_);
      device_ = Tensor();
      where_ = Where::HandedOut;
      break;
  }
  return out;
}

void OffloadedTensor::let_device_copy_go() {
  release_device_copy();
  where_ = Where::OnHost;
}

void OffloadedTensor::release_device_copy() {
#ifdef LEASEHOLD_HAVE_CUDA
  // (Its memory may serve the compute stream's next allocation: the stream
  // first waits for the copy that reads or writes it.)
  if (stream_ && device_.defined() && (where_ == Where::CopyingOut || where_ == Where::CopyingIn)) {
    cudaEvent_t done = where_ == Where::CopyingOut ? slot_->out_done : slot_->in_done;
    cudaError_t err = cudaStreamWaitEvent(static_cast<cudaStream_t>(stream_), done, 0);
    if (err != cudaSuccess) {
      // (Only a lost context fails here; then nothing runs any more that
      // could read the memory.)
      (void)cudaGetLastError();
    }
  }
#endif
  device_ = Tensor();
}

OffloadedTensor::~OffloadedTensor() {
  release_device_copy();
  if (offloaded_) slot_->claimed = false;
}

void offload_progress() {
  Queue& q = t_queue;
  ++q.progress;
  for (const auto& w : q.stashed) {
    auto h = w.lock();
    if (h && h->where_ == OffloadedTensor::Where::CopyingOut && !h->read_in_place_ &&
        q.progress >= h->stashed_at_ + kOffloadReleaseAfterBlocks) {
      h->let_device_copy_go();
    }
  }
  q.prune();
}

void offload_prefetch_next() {
  using Where = OffloadedTensor::Where;
  Queue& q = t_queue;
  // The latest stashed that backward has not read yet comes next; one on
  // its way in already is that one (one ahead at a time).
  std::shared_ptr<OffloadedTensor> next;
  bool coming_in = false;
  for (auto it = q.stashed.rbegin(); it != q.stashed.rend(); ++it) {
    auto h = it->lock();
    if (!h) continue;
    if (h->where_ == Where::CopyingIn) {
      coming_in = true;
      continue;
    }
    const bool unread =
        h->where_ == Where::OnHost || (h->where_ == Where::CopyingOut && !h->read_in_place_);
    if (!unread) continue;
    if (!next && !coming_in) {
      next = std::move(h);
    } else if (h->where_ == Where::CopyingOut) {
      // (Still on the device, forward having ended too few blocks after
      // it: backward comes to it later than to the next, and its memory
      // is wanted sooner.)
      h->let_device_copy_go();
    }
  }
  // (Still on the device: it stays there, read in place. Memory for a
  // fetch is asked as for any tensor of the step: a CUDA graph's trace
  // counts it, and op by op running short spills or fails the step as any
  // allocation would.)
  if (next && next->where_ == Where::OnHost) next->fetch();
}

}  // namespace leasehold::engine
