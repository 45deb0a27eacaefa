// TieredSpillStore (tiered_store.h): its staging slots, waiting for a
// tensor's copies off the device, prefetches and gets from either tier.
#include "agent/spill/tiered_store_impl.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstring>
#include <string>

namespace leasehold::spill {

using tiered_store_detail::from_exception;

int TieredSpillStore::Impl::take_free_slot_locked() {
  for (int i = 0; i < nslots_; ++i) {
    Slot& s = slots_[static_cast<size_t>(i)];
    if (s.state != SlotState::Free) continue;
    if (s.h2d) {
      if (!s.h2d->done()) continue;
      s.h2d.reset();
    }
    return i;
  }
  return -1;
}

int TieredSpillStore::Impl::acquire_slot(std::unique_lock<std::mutex>& lock,
                                         std::optional<SpillId> keep, size_t keep_chunk) {
  for (;;) {
    int s = take_free_slot_locked();
    if (s >= 0) return s;
    // The oldest copy out of a free slot: wait for it on the host.
    int oldest = -1;
    bool io_busy = false;
    for (int i = 0; i < nslots_; ++i) {
      const Slot& slot = slots_[static_cast<size_t>(i)];
      if (slot.state == SlotState::Free &&
          (oldest < 0 || slot.last_use < slots_[static_cast<size_t>(oldest)].last_use)) {
        oldest = i;
      }
      io_busy |= slot.state == SlotState::Writing || slot.state == SlotState::Reading;
    }
    if (oldest >= 0) {
      std::shared_ptr<Fence> f = slots_[static_cast<size_t>(oldest)].h2d;
      lock.unlock();
      try {
        f->wait();
      } catch (...) {
        lock.lock();
        throw;
      }
      lock.lock();
      continue;
    }
    if (io_busy) {
      io_done_.wait(lock);
      continue;
    }
    // Every slot holds a chunk read back for a later get: take one back,
    // the one needed last. Its chunk is simply read again when needed.
    // Other entries' chunks (prefetched for later gets) go first, oldest
    // first; then the chunks of `keep` farthest after `keep_chunk`.
    auto rank = [&](const Slot& slot) {
      bool mine = keep && slot.owner == *keep;
      return std::pair<int, uint64_t>(mine ? 1 : 0, mine ? UINT64_MAX - slot.chunk : slot.last_use);
    };
    int victim = -1;
    for (int i = 0; i < nslots_; ++i) {
      const Slot& slot = slots_[static_cast<size_t>(i)];
      if (slot.state != SlotState::Loaded) continue;
      if (keep && slot.owner == *keep && slot.chunk <= keep_chunk) continue;
      if (victim < 0 || rank(slot) < rank(slots_[static_cast<size_t>(victim)])) victim = i;
    }
    if (victim < 0) return -1;
    Slot& v = slots_[static_cast<size_t>(victim)];
    entries_.at(v.owner).chunks[v.chunk].slot = -1;
    release_slot_locked(victim);
  }
}

void TieredSpillStore::Impl::release_slot_locked(int s) {
  Slot& slot = slots_[static_cast<size_t>(s)];
  if (slot.prefetched) --prefetch_slots_;
  slot.state = SlotState::Free;
  slot.owner = 0;
  slot.chunk = 0;
  slot.prefetched = false;
  slot.read_status = Status::OK();
}

void TieredSpillStore::Impl::issue_read_locked(SpillId id, Entry& e, size_t k, int s,
                                               bool prefetched) {
  Chunk& c = e.chunks[k];
  Slot& slot = slots_[static_cast<size_t>(s)];
  slot.state = SlotState::Reading;
  slot.owner = id;
  slot.chunk = k;
  slot.prefetched = prefetched;
  slot.read_status = Status::OK();
  slot.last_use = ++use_clock_;
  if (prefetched) ++prefetch_slots_;
  c.slot = s;
  Task t = task_for(/*write=*/false, id, e, k, s);
  t.hash = c.hash;
  enqueue_locked(e, std::move(t));
}

TieredSpillStore::Impl::Task TieredSpillStore::Impl::task_for(bool write, SpillId id,
                                                              const Entry& e, size_t k, int s) {
  Task t;
  t.write = write;
  t.id = id;
  t.chunk = k;
  t.slot = s;
  t.offset = e.chunks[k].offset;
  t.len = e.chunks[k].len;
  t.name = e.name;
  return t;
}

void TieredSpillStore::Impl::enqueue_locked(Entry& e, Task t) {
  tasks_.push_back(std::move(t));
  ++e.io_pending;
  ++io_pending_;
  work_ready_.notify_one();
}

void TieredSpillStore::Impl::drop_locked(std::unique_lock<std::mutex>& lock, SpillId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Entry& e = it->second;
  io_done_.wait(lock, [&] { return e.io_pending == 0; });
  if (e.tier == Tier::Host) {
    // A copy into the region may still run: the next put's copy into it is
    // queued behind it on the same copy stream, and a planned tensor waits
    // for it (host_tier.h).
    host_->free_after(e.offset, e.fence);
    stats_.host_bytes -= e.bytes;
  } else if (e.tier == Tier::File) {
    for (Chunk& c : e.chunks) {
      if (c.slot >= 0) release_slot_locked(c.slot);
    }
    file_->free(e.offset);
    stats_.file_bytes -= e.bytes;
  }
  entries_.erase(it);
}

bool TieredSpillStore::Impl::copied(SpillId id) {
  std::lock_guard lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return true;
  Entry& e = it->second;
  try {
    if (e.fence) {
      if (!e.fence->done()) return false;
      e.fence.reset();
    }
    for (Chunk& c : e.chunks) {
      if (!c.d2h) continue;
      if (!c.d2h->done()) return false;
      c.d2h.reset();
    }
  } catch (const std::exception& ex) {
    // The copy will never finish: report done so the caller moves on to
    // wait_copied() or get(), which report the fault.
    if (e.error.ok())
      e.error = from_exception("cannot copy tensor " + e.name + " off the device", ex);
  }
  return true;
}

Status TieredSpillStore::Impl::wait_copied(SpillId id) {
  std::unique_lock lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return Status::not_found("spill id " + std::to_string(id) + " is not stored");
  }
  Entry& e = it->second;
  std::vector<std::shared_ptr<Fence>> fences;
  if (e.fence) fences.push_back(e.fence);
  for (const Chunk& c : e.chunks) {
    if (c.d2h) fences.push_back(c.d2h);
  }
  lock.unlock();
  Status st;
  try {
    for (auto& f : fences) f->wait();
  } catch (const std::exception& ex) {
    st = from_exception("cannot copy tensor " + e.name + " off the device", ex);
  }
  lock.lock();
  // The entry is still there: only this thread erases.
  if (!st.ok() && e.error.ok()) e.error = st;
  if (st.ok()) {
    e.fence.reset();
    for (Chunk& c : e.chunks) c.d2h.reset();
  }
  return e.error;
}

void TieredSpillStore::Impl::prefetch(SpillId id) {
  std::lock_guard lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end() || it->second.tier != Tier::File || !it->second.error.ok()) return;
  Entry& e = it->second;
  try {
    for (size_t k = 0; k < e.chunks.size() && prefetch_slots_ < max_prefetch_slots_; ++k) {
      const Chunk& c = e.chunks[k];
      if (c.slot >= 0 || !c.written) continue;
      int s = take_free_slot_locked();
      if (s < 0) break;
      issue_read_locked(id, e, k, s, /*prefetched=*/true);
    }
  } catch (const std::exception& ex) {
    // A hint only; a device fault seen here surfaces again at the next get.
    spdlog::debug("spill prefetch of tensor {}: {}", e.name, ex.what());
  }
}

// `done` null: the compute stream waits for the copies; else *done is
// their fence and the caller orders the compute stream (get_async).
Status TieredSpillStore::Impl::get(SpillId id, void* dst, std::shared_ptr<Fence>* done) {
  std::unique_lock lock(mu_);
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return Status::not_found("spill id " + std::to_string(id) + " is not stored");
  }
  Entry& e = it->second;
  if (!e.error.ok()) return e.error;
  if (e.tier == Tier::None) return Status::OK();
  Status st;
  if (e.tier == Tier::Host) {
    lock.unlock();
    try {
      transfer_.to_device(dst, host_->data(e.offset), e.bytes);
      std::shared_ptr<Fence> f = transfer_.mark();
      if (done) {
        *done = std::move(f);
      } else {
        transfer_.compute_waits(f);
      }
    } catch (const std::exception& ex) {
      st = from_exception("cannot copy tensor " + e.name + " to the device", ex);
    }
    lock.lock();
  } else {
    try {
      st = get_file(lock, id, e, static_cast<char*>(dst), done);
    } catch (const std::exception& ex) {
      if (!lock.owns_lock()) lock.lock();
      st = from_exception("cannot bring tensor " + e.name + " back from spill file " + path_, ex);
    }
  }
  if (st.ok()) stats_.bytes_in += e.bytes;
  return st;
}

Status TieredSpillStore::Impl::get_file(std::unique_lock<std::mutex>& lock, SpillId id, Entry& e,
                                        char* dst, std::shared_ptr<Fence>* done) {
  const size_t n = e.chunks.size();
  std::shared_ptr<Fence> last;
  for (size_t k = 0; k < n;) {
    if (!e.error.ok()) return e.error;
    // Keep reads in flight ahead of the chunk being delivered, in chunk
    // order, as far as free slots allow.
    for (size_t j = k; j < n; ++j) {
      const Chunk& c = e.chunks[j];
      if (c.slot >= 0 || !c.written) continue;
      int s = take_free_slot_locked();
      if (s < 0) break;
      issue_read_locked(id, e, j, s, /*prefetched=*/false);
    }
    Chunk& c = e.chunks[k];
    if (c.slot < 0) {
      // Neither in staging nor on its way: its write finished after the
      // loop above looked, or no slot was free.
      int s = acquire_slot(lock, id, k);
      if (!e.error.ok()) return e.error;
      if (s < 0) {
        return Status::io_error("cannot read tensor " + e.name + " back from spill file " + path_ +
                                    ": no staging buffer can be had",
                                EBUSY);
      }
      if (c.slot >= 0) {
        // Cannot happen (only this thread gives chunks a slot), but taking a
        // second slot for the chunk would leak one.
        release_slot_locked(s);
      } else {
        issue_read_locked(id, e, k, s, /*prefetched=*/false);
      }
    }
    io_done_.wait(lock, [&] {
      return c.slot < 0 || slots_[static_cast<size_t>(c.slot)].state != SlotState::Reading;
    });
    if (c.slot < 0) continue;  // its write finished and freed the slot: read it back
    const int s = c.slot;
    Slot& slot = slots_[static_cast<size_t>(s)];
    const bool staged = slot.state == SlotState::Writing;
    if (!staged && !slot.read_status.ok()) {
      Status st = slot.read_status;
      c.slot = -1;
      release_slot_locked(s);
      return st;
    }
    if (staged) ++stats_.staging_hits;
    // The copy runs without the lock. A Writing slot may be freed by its
    // I/O thread meanwhile, but only this thread hands slots out again, and
    // it gives the slot its fence below first.
    const char* src = slot_data(s);
    const size_t len = c.len;
    lock.unlock();
    std::shared_ptr<Fence> f;
    try {
      transfer_.to_device(dst + k * chunk_, src, len);
      f = transfer_.mark();
    } catch (...) {
      lock.lock();
      if (!staged) {
        c.slot = -1;
        release_slot_locked(s);
      }
      throw;
    }
    lock.lock();
    slot.h2d = f;
    if (!staged) {
      c.slot = -1;
      release_slot_locked(s);
    }
    last = std::move(f);
    ++k;
  }
  if (done) {
    *done = std::move(last);
    return Status::OK();
  }
  lock.unlock();
  try {
    transfer_.compute_waits(last);
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  return Status::OK();
}

}  // namespace leasehold::spill
