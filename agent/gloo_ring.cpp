#include "agent/gloo_ring.h"

#include <algorithm>

namespace leasehold {

GlooRing::GlooRing(std::shared_ptr<gloo::Context> context, std::chrono::milliseconds timeout)
    : context_(std::move(context)), timeout_(timeout) {}

void GlooRing::abort() {
  std::lock_guard lock(mu_);
  aborted_ = true;
  // An abort that lands between two waits is kept by the buffer and ends
  // the next one.
  for (Buffer* b : {scratch_buf_.get(), data_buf_}) {
    if (b == nullptr) continue;
    b->abortWaitRecv();
    b->abortWaitSend();
  }
}

bool GlooRing::wait(Buffer& buf, bool recv) {
  return recv ? buf.waitRecv(timeout_) : buf.waitSend(timeout_);
}

bool GlooRing::allreduce(float* data, size_t n) {
  const int size = context_->size;
  const int rank = context_->rank;
  if (size == 1 || n == 0) return true;

  const size_t chunk = (n + static_cast<size_t>(size) - 1) / static_cast<size_t>(size);
  auto mod = [size](int c) { return ((c % size) + size) % size; };
  auto first = [&](int c) { return std::min(n, static_cast<size_t>(c) * chunk); };
  auto count = [&](int c) { return std::min(n, static_cast<size_t>(c + 1) * chunk) - first(c); };
  constexpr size_t F = sizeof(float);

  std::unique_ptr<Buffer> data_buf = context_->createUnboundBuffer(data, n * F);
  {
    std::lock_guard lock(mu_);
    if (aborted_) return false;
    if (scratch_.size() < chunk) {
      scratch_buf_.reset();
      scratch_.resize(chunk);
      scratch_buf_ = context_->createUnboundBuffer(scratch_.data(), chunk * F);
    }
    data_buf_ = data_buf.get();
  }
  // abort() must not reach data_buf once it is gone.
  struct Unpublish {
    GlooRing* ring;
    ~Unpublish() {
      std::lock_guard lock(ring->mu_);
      ring->data_buf_ = nullptr;
    }
  } unpublish{this};

  Buffer& mine = *data_buf;
  Buffer& theirs = *scratch_buf_;
  const uint64_t slot = context_->nextSlot();
  const int next = (rank + 1) % size;
  const int prev = (rank + size - 1) % size;

  // Reduce-scatter: after step s, chunk rank - s - 1 holds the sum of s + 2
  // ranks' data; after the last step this rank holds chunk rank + 1 whole.
  for (int s = 0; s + 1 < size; ++s) {
    const int out = mod(rank - s), in = mod(rank - s - 1);
    if (count(in) > 0) theirs.recv(prev, slot, 0, count(in) * F);
    if (count(out) > 0) mine.send(next, slot, first(out) * F, count(out) * F);
    if (count(in) > 0) {
      if (!wait(theirs, true)) return false;
      float* dst = data + first(in);
      for (size_t i = 0, m = count(in); i < m; ++i) dst[i] += scratch_[i];
    }
    if (count(out) > 0 && !wait(mine, false)) return false;
  }
  // All-gather: pass the finished chunks round the ring.
  for (int s = 0; s + 1 < size; ++s) {
    const int out = mod(rank + 1 - s), in = mod(rank - s);
    if (count(in) > 0) mine.recv(prev, slot, first(in) * F, count(in) * F);
    if (count(out) > 0) mine.send(next, slot, first(out) * F, count(out) * F);
    if (count(in) > 0 && !wait(mine, true)) return false;
    if (count(out) > 0 && !wait(mine, false)) return false;
  }
  return true;
}

}  // namespace leasehold
