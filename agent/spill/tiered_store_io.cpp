// TieredSpillStore (tiered_store.h): its I/O threads, which write staged
// chunks to the spill file with their checksums and read them back.
#include "agent/spill/tiered_store_impl.h"

#include <spdlog/spdlog.h>

#include <string>

// Header-only use of xxHash: no runtime library to ship or find.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "shared/units.h"

namespace leasehold::spill {

using tiered_store_detail::from_exception;
using tiered_store_detail::kPage;
using tiered_store_detail::Clock;

void TieredSpillStore::Impl::start_threads_locked() {
  if (!threads_.empty()) return;
  threads_.reserve(static_cast<size_t>(opt_.io_threads));
  try {
    for (int i = 0; i < opt_.io_threads; ++i) threads_.emplace_back([this] { worker(); });
  } catch (...) {
    // Called with mu_ held: the threads started so far are waiting for it
    // (or for work) and see stop_ once it is released.
    stop_ = true;
    work_ready_.notify_all();
    throw;
  }
}

void TieredSpillStore::Impl::worker() {
  for (;;) {
    Task t;
    {
      std::unique_lock lock(mu_);
      work_ready_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      t = std::move(tasks_.front());
      tasks_.pop_front();
    }
    if (t.write) {
      run_write(t);
    } else {
      run_read(t);
    }
  }
}

void TieredSpillStore::Impl::io_begin() {
  std::lock_guard lock(busy_mu_);
  if (io_active_++ == 0) io_since_ = Clock::now();
}

void TieredSpillStore::Impl::io_end() {
  std::lock_guard lock(busy_mu_);
  if (--io_active_ == 0) io_busy_ += Clock::now() - io_since_;
}

void TieredSpillStore::Impl::run_write(Task& t) {
  char* p = slot_data(t.slot);
  const size_t padded = align_up(t.len, kPage);
  uint64_t hash = 0;
  Status st;
  try {
    t.fence->wait();
  } catch (const std::exception& ex) {
    st = from_exception("cannot copy " + chunk_where(t) + " off the device", ex);
  }
  if (st.ok()) {
    // Padding to whole pages for O_DIRECT; the checksum covers it too, so
    // a read is checked exactly as it was written.
    std::memset(p + t.len, 0, padded - t.len);
    hash = XXH3_64bits(p, padded);
    io_begin();
    int err = file_->write(p, padded, t.offset);
    io_end();
    if (err != 0) {
      st = Status::io_error("cannot write " + chunk_where(t) + " to spill file " + path_, err);
    }
  }
  {
    std::lock_guard lock(mu_);
    Entry& e = entries_.at(t.id);
    Chunk& c = e.chunks[t.chunk];
    if (st.ok()) {
      c.d2h.reset();  // waited for above
      c.hash = hash;
      c.written = true;
      stats_.file_bytes_written += padded;
    } else {
      spdlog::error("spill store: {}", st.message());
      if (e.error.ok()) e.error = st;
      if (sticky_.ok()) sticky_ = st;
    }
    c.slot = -1;
    release_slot_locked(t.slot);
    --e.io_pending;
    --io_pending_;
  }
  io_done_.notify_all();
}

void TieredSpillStore::Impl::run_read(Task& t) {
  char* p = slot_data(t.slot);
  const size_t padded = align_up(t.len, kPage);
  io_begin();
  int err = file_->read(p, padded, t.offset);
  io_end();
  Status st;
  if (err > 0) {
    st = Status::io_error("cannot read " + chunk_where(t) + " from spill file " + path_, err);
  } else if (err < 0) {
    st = Status::corruption("spill file " + path_ + ": truncated in " + chunk_where(t));
  } else if (XXH3_64bits(p, padded) != t.hash) {
    st = Status::corruption("spill file " + path_ + ": checksum mismatch in " + chunk_where(t));
  }
  {
    std::lock_guard lock(mu_);
    Entry& e = entries_.at(t.id);
    Slot& slot = slots_[static_cast<size_t>(t.slot)];
    slot.state = SlotState::Loaded;
    slot.read_status = st;
    if (err == 0) stats_.file_bytes_read += padded;
    --e.io_pending;
    --io_pending_;
  }
  io_done_.notify_all();
}

}  // namespace leasehold::spill
