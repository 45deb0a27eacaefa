// TieredSpillStore (tiered_store.h): the store's life, puts into the host
// tier or the file, erase and stats; the slots and gets are in
// tiered_store_reads.cpp, the I/O threads in tiered_store_io.cpp.
#include "agent/spill/tiered_store_impl.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "shared/pool_allocator.h"
#include "shared/units.h"

namespace leasehold::spill {

using tiered_store_detail::bytes_text;
using tiered_store_detail::from_exception;
using tiered_store_detail::kPage;
using tiered_store_detail::Clock;

TieredSpillStore::Impl::Impl(Transfer& transfer, TieredStoreOptions options)
    : transfer_(transfer), opt_(std::move(options)), chunk_(opt_.chunk_bytes) {
  if (opt_.host_tier && opt_.host_tier->size() >= kPage) {
    host_ = std::make_shared<HostTier>(opt_.host_tier->data(), opt_.host_tier->size(),
                                       opt_.host_limit, kPage);
    // (A tier under one page holds no planned tensor: none are planned.)
    if (host_->limit() >= kPage) {
      host_allocator_ = std::make_shared<HostTierAllocator>(host_, transfer_.device());
    }
  }
  // Bad options disable the file tier with a reason that put() reports, so
  // that construction never fails (see the header).
  if (!opt_.staging || opt_.directory.empty()) {
    file_tier_problem_ = Status::invalid_argument("no spill file configured");
  } else if (chunk_ == 0 || chunk_ % kPage != 0) {
    file_tier_problem_ = Status::invalid_argument("spill chunk size " + bytes_text(chunk_) +
                                                  " is not a positive multiple of 4 KiB");
  } else if (opt_.staging->size() / chunk_ < 2) {
    file_tier_problem_ =
        Status::invalid_argument("spill staging buffer of " + bytes_text(opt_.staging->size()) +
                                 " holds fewer than 2 chunks of " + bytes_text(chunk_));
  } else if (opt_.io_threads < 1) {
    file_tier_problem_ = Status::invalid_argument("spill store needs at least one I/O thread");
  } else {
    nslots_ = static_cast<int>(opt_.staging->size() / chunk_);
    max_prefetch_slots_ = std::max(1, nslots_ / 2);
    slots_.resize(static_cast<size_t>(nslots_));
  }
}

TieredSpillStore::Impl::~Impl() {
  std::unique_lock lock(mu_);
  // The tasks read and write the caller's staging buffer and this object.
  io_done_.wait(lock, [&] { return io_pending_ == 0; });
  stop_ = true;
  lock.unlock();
  work_ready_.notify_all();
  for (auto& t : threads_) t.join();
  // Copies out of the host tier and the staging buffer may still be queued
  // on the copy stream; the caller frees those buffers after the store.
  if (stats_.bytes_out > 0) {
    try {
      transfer_.mark()->wait();
    } catch (const std::exception& ex) {
      spdlog::error("spill store: waiting for copies in flight: {}", ex.what());
    }
  }
  file_.reset();  // closes and removes the file
  // (The job's tensors go before its spill manager: a range still held
  // would be handed out again by the next job's store over the same tier.)
  if (host_allocator_ && host_allocator_->stats().in_use_bytes > 0) {
    spdlog::critical("spill store: {} of the job's page-locked tensors outlive its host tier",
                     format_bytes(host_allocator_->stats().in_use_bytes));
  }
}

Status TieredSpillStore::Impl::no_room(const std::string& name, size_t bytes,
                                       const std::string& why) const {
  std::string host = host_ ? format_bytes(host_->used_bytes()) + " of " +
                                  format_bytes(host_->limit()) + " used"
                            : std::string("none");
  if (host_allocator_ && host_allocator_->stats().in_use_bytes > 0) {
    host += " (" + format_bytes(host_allocator_->stats().in_use_bytes) +
            " of it the job's page-locked tensors)";
  }
  return Status::io_error("no room to spill tensor " + name + " (" + bytes_text(bytes) +
                              "): host tier " + host + ", " + why,
                          ENOSPC);
}

Status TieredSpillStore::Impl::put(SpillId id, const void* src, size_t bytes,
                                   const std::string& name) {
  std::unique_lock lock(mu_);
  if (!sticky_.ok()) return sticky_;
  if (entries_.count(id)) {
    return Status::invalid_argument("spill id " + std::to_string(id) + " (tensor " + name +
                                    ") is already stored");
  }
  const char* p = static_cast<const char*>(src);
  if (bytes == 0) {
    Entry& e = entries_[id];
    e.name = name;
    return Status::OK();
  }
  if (host_) {
    if (const auto offset = host_->allocate(bytes, PoolAllocator::End::Low)) {
      return put_host(lock, id, p, bytes, name, *offset);
    }
  }
  if (!file_tier_problem_.ok()) {
    if (file_tier_problem_.is_io_error()) return file_tier_problem_;
    return no_room(name, bytes, file_tier_problem_.message());
  }
  return put_file(lock, id, p, bytes, name);
}

Status TieredSpillStore::Impl::put_host(std::unique_lock<std::mutex>& lock, SpillId id,
                                        const char* src, size_t bytes, const std::string& name,
                                        uint64_t offset) {
  Entry& e = entries_[id];
  e.name = name;
  e.bytes = bytes;
  e.tier = Tier::Host;
  e.offset = offset;
  // Copies run without the lock: only this thread touches the region.
  lock.unlock();
  std::shared_ptr<Fence> fence;
  Status st;
  try {
    transfer_.to_host(host_->data(offset), src, bytes);
    fence = transfer_.mark();
  } catch (const std::exception& ex) {
    st = from_exception("cannot copy tensor " + name + " off the device", ex);
  }
  lock.lock();
  if (!st.ok()) {
    host_->free(offset);
    entries_.erase(id);
    return st;
  }
  e.fence = std::move(fence);
  stats_.host_bytes += bytes;
  stats_.peak_host_bytes = std::max(stats_.peak_host_bytes, stats_.host_bytes);
  stats_.bytes_out += bytes;
  return Status::OK();
}

Status TieredSpillStore::Impl::open_file_locked() {
  if (file_) return Status::OK();
  std::unique_ptr<SpillFile> file;
  Status st = SpillFile::create(opt_.directory, opt_.tag, opt_.direct_io, opt_.file_limit, &file);
  if (!st.ok()) return st;
  try {
    start_threads_locked();
  } catch (const std::exception& ex) {
    // The threads that did start are stopping: no file tier from now on
    // (`file` is removed on return).
    file_tier_problem_ = from_exception("cannot start the spill store's I/O threads", ex);
    return file_tier_problem_;
  }
  path_ = file->path();
  file_ = std::move(file);
  return Status::OK();
}

Status TieredSpillStore::Impl::put_file(std::unique_lock<std::mutex>& lock, SpillId id,
                                        const char* src, size_t bytes, const std::string& name) {
  Status st = open_file_locked();
  if (!st.ok()) return st;
  std::optional<uint64_t> placed = file_->place(bytes);
  if (!placed) return no_room(name, bytes, file_->fullness());
  const uint64_t offset = *placed;
  st = file_->grow_to(offset + align_up(bytes, kPage));
  if (!st.ok()) {
    file_->free(offset);
    return st;
  }

  Entry& e = entries_[id];
  e.name = name;
  e.bytes = bytes;
  e.tier = Tier::File;
  e.offset = offset;
  size_t n = (bytes + chunk_ - 1) / chunk_;
  e.chunks.resize(n);
  for (size_t k = 0; k < n; ++k) {
    e.chunks[k].offset = offset + k * chunk_;
    e.chunks[k].len = std::min(chunk_, bytes - k * chunk_);
  }
  stats_.file_bytes += bytes;
  stats_.peak_file_bytes = std::max(stats_.peak_file_bytes, stats_.file_bytes);

  for (size_t k = 0; k < n; ++k) {
    int s = -1;
    try {
      s = acquire_slot(lock, std::nullopt, 0);
    } catch (const std::exception& ex) {
      st = from_exception("cannot spill tensor " + name + ": waiting for a staging buffer", ex);
    }
    if (st.ok() && s < 0) {
      st =
          Status::io_error("cannot spill tensor " + name + ": no staging buffer can be had", EBUSY);
    }
    if (!st.ok()) break;
    Slot& slot = slots_[static_cast<size_t>(s)];
    slot.state = SlotState::Writing;  // reserved: no other thread takes a Writing slot
    slot.owner = id;
    slot.chunk = k;
    slot.prefetched = false;
    slot.last_use = ++use_clock_;
    Chunk& c = e.chunks[k];
    c.slot = s;
    size_t len = c.len;
    char* dst = slot_data(s);
    // The copy runs without the lock, so finished writes can free slots.
    lock.unlock();
    std::shared_ptr<Fence> fence;
    try {
      transfer_.to_host(dst, src + k * chunk_, len);
      fence = transfer_.mark();
    } catch (const std::exception& ex) {
      st = from_exception("cannot copy tensor " + name + " off the device", ex);
    }
    lock.lock();
    if (!st.ok()) {
      release_slot_locked(s);
      c.slot = -1;
      break;
    }
    c.d2h = fence;
    Task t = task_for(/*write=*/true, id, e, k, s);
    t.len = len;
    t.fence = std::move(fence);
    enqueue_locked(e, std::move(t));
  }
  if (!st.ok()) {
    drop_locked(lock, id);
    return st;
  }
  stats_.bytes_out += bytes;
  return Status::OK();
}

void TieredSpillStore::Impl::erase(SpillId id) {
  std::unique_lock lock(mu_);
  drop_locked(lock, id);
}

Status TieredSpillStore::Impl::flush() {
  std::unique_lock lock(mu_);
  io_done_.wait(lock, [&] { return io_pending_ == 0; });
  return sticky_;
}

SpillStats TieredSpillStore::Impl::stats() const {
  SpillStats s;
  {
    std::lock_guard lock(mu_);
    s = stats_;
  }
  {
    std::lock_guard lock(busy_mu_);
    Clock::duration busy = io_busy_;
    if (io_active_ > 0) busy += Clock::now() - io_since_;
    s.file_busy_seconds = std::chrono::duration<double>(busy).count();
  }
  try {
    s.copy_busy_seconds = transfer_.busy_seconds();
  } catch (const std::exception& ex) {
    spdlog::debug("spill store statistics: {}", ex.what());
  }
  return s;
}

std::string TieredSpillStore::Impl::file_path() const {
  std::lock_guard lock(mu_);
  return path_;
}

TieredSpillStore::TieredSpillStore(Transfer& transfer, TieredStoreOptions options)
    : impl_(std::make_unique<Impl>(transfer, std::move(options))) {}

TieredSpillStore::~TieredSpillStore() = default;

Status TieredSpillStore::put(SpillId id, const void* src, size_t bytes, const std::string& name) {
  try {
    return impl_->put(id, src, bytes, name);
  } catch (const std::exception& ex) {
    return from_exception("cannot spill tensor " + name, ex);
  }
}

bool TieredSpillStore::copied(SpillId id) { return impl_->copied(id); }

Status TieredSpillStore::wait_copied(SpillId id) {
  try {
    return impl_->wait_copied(id);
  } catch (const std::exception& ex) {
    return from_exception("cannot wait for spilled tensor " + std::to_string(id), ex);
  }
}

void TieredSpillStore::prefetch(SpillId id) {
  try {
    impl_->prefetch(id);
  } catch (const std::exception& ex) {
    spdlog::debug("spill prefetch of id {}: {}", id, ex.what());
  }
}

Status TieredSpillStore::get(SpillId id, void* dst) {
  try {
    return impl_->get(id, dst, nullptr);
  } catch (const std::exception& ex) {
    return from_exception("cannot bring spilled tensor " + std::to_string(id) + " back", ex);
  }
}

Status TieredSpillStore::get_async(SpillId id, void* dst, std::shared_ptr<Fence>* done) {
  try {
    *done = nullptr;
    return impl_->get(id, dst, done);
  } catch (const std::exception& ex) {
    return from_exception("cannot bring spilled tensor " + std::to_string(id) + " back", ex);
  }
}

void TieredSpillStore::erase(SpillId id) {
  try {
    impl_->erase(id);
  } catch (const std::exception& ex) {
    spdlog::error("spill store: erasing id {}: {}", id, ex.what());
  }
}

SpillStats TieredSpillStore::stats() const { return impl_->stats(); }

std::shared_ptr<engine::Allocator> TieredSpillStore::host_allocator() {
  return impl_->host_allocator();
}

Status TieredSpillStore::flush() {
  try {
    return impl_->flush();
  } catch (const std::exception& ex) {
    return from_exception("cannot flush the spill store", ex);
  }
}

std::string TieredSpillStore::file_path() const { return impl_->file_path(); }

}  // namespace leasehold::spill
