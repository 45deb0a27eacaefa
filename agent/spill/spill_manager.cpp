#include "agent/spill/spill_manager.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <vector>

#include "shared/units.h"

namespace leasehold::spill {

namespace E = engine;

// What a saved tensor becomes: its entry and how to view the entry's
// storage. The last handle of an entry forgets it.
class SpillManager::Handle {
 public:
  Handle(std::shared_ptr<SpillManager> manager, uint64_t seq, const E::Tensor& t)
      : manager_(std::move(manager)),
        seq_(seq),
        sizes_(t.sizes()),
        strides_(t.strides()),
        offset_(t.storage_offset()),
        dtype_(t.dtype()) {}
  ~Handle() { manager_->drop_handle(seq_); }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;

  uint64_t seq() const { return seq_; }
  E::Tensor view(std::shared_ptr<E::Storage> storage) const {
    auto impl = std::make_shared<E::TensorImpl>();
    impl->storage = std::move(storage);
    impl->sizes = sizes_;
    impl->strides = strides_;
    impl->offset = offset_;
    impl->dtype = dtype_;
    return E::Tensor(std::move(impl));
  }

 private:
  std::shared_ptr<SpillManager> manager_;
  uint64_t seq_;
  E::Shape sizes_, strides_;
  int64_t offset_;
  E::DType dtype_;
};

std::shared_ptr<SpillManager> SpillManager::create(std::unique_ptr<SpillStore> store,
                                                   std::shared_ptr<Transfer> transfer,
                                                   std::shared_ptr<E::Allocator> allocator,
                                                   SpillPolicy policy) {
  std::shared_ptr<SpillManager> m(
      new SpillManager(std::move(store), std::move(transfer), allocator, policy));
  std::weak_ptr<SpillManager> weak = m;
  allocator->set_reclaimer([weak](uint64_t bytes) -> uint64_t {
    auto self = weak.lock();
    return self ? self->reclaim(bytes) : 0;
  });
  return m;
}

SpillManager::SpillManager(std::unique_ptr<SpillStore> store, std::shared_ptr<Transfer> transfer,
                           std::shared_ptr<E::Allocator> allocator, SpillPolicy policy)
    : transfer_(std::move(transfer)),
      allocator_(std::move(allocator)),
      store_(std::move(store)),
      policy_(policy) {}

SpillManager::~SpillManager() {
  // Every handle holds the manager, so no entry is left; the reclaimer's
  // weak reference already fails, and is removed here. The store goes
  // first: it waits for its copies on the transfer.
  allocator_->set_reclaimer({});
  store_.reset();
}

void SpillManager::keep_resident(const std::vector<E::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (t.defined() && t.impl()->storage) kept_.insert(t.impl()->storage.get());
  }
}

size_t SpillManager::evicted_entries() const {
  size_t n = 0;
  for (const auto& [seq, e] : entries_) n += e.storage ? 0 : 1;
  return n;
}

void SpillManager::fail(const Entry& e, const char* what, const Status& st) const {
  throw SpillError(std::string("cannot ") + what + " " + e.name + ": " + st.to_string());
}

std::any SpillManager::pack(const E::Tensor& t) {
  const auto& storage = t.impl()->storage;
  // Only the job's own memory counts against its budget and can be freed;
  // parameters and optimiser state stay.
  if (!storage || storage->allocator() != allocator_ || storage->bytes() < policy_.min_bytes ||
      kept_.count(storage.get())) {
    return t;
  }
  uint64_t seq;
  if (auto it = resident_.find(storage.get()); it != resident_.end()) {
    seq = it->second;
  } else {
    seq = next_seq_++;
    Entry e;
    e.storage = storage;
    e.bytes = storage->bytes();
    e.name = "saved tensor #" + std::to_string(seq) + " " + t.shape_str() + " (" +
             format_bytes(e.bytes) + ")";
    e.hot = E::in_backward();
    entries_.emplace(seq, std::move(e));
    resident_.emplace(storage.get(), seq);
  }
  ++entries_.at(seq).handles;
  auto handle = std::make_shared<Handle>(shared_from_this(), seq, t);
  if (pressured_) offload_ahead();
  return handle;
}

E::Tensor SpillManager::unpack(const std::any& packed) {
  if (const auto* plain = std::any_cast<E::Tensor>(&packed)) return *plain;
  const auto& handle = std::any_cast<const std::shared_ptr<Handle>&>(packed);
  uint64_t seq = handle->seq();
  Entry& e = entries_.at(seq);
  ensure_resident(seq, e);
  E::Tensor t = handle->view(e.storage);
  prefetch_before(seq, e.bytes);
  return t;
}

bool SpillManager::evictable(const Entry& e) const {
  // Only the entry holds the storage: freeing it frees device memory.
  return e.storage && e.storage.use_count() == 1 && e.state != State::Restoring;
}

void SpillManager::start_copy(uint64_t seq, Entry& e) {
  if (e.stored) {
    e.state = State::Stored;  // the store still holds the bytes: nothing to copy
    return;
  }
  if (Status st = store_->put(seq, e.storage->data(), e.bytes, e.name); !st.ok()) {
    fail(e, "spill", st);
  }
  e.stored = true;
  e.state = State::Stored;
}

void SpillManager::evict(Entry& e) {
  resident_.erase(e.storage.get());
  e.storage.reset();  // the allocator gets the memory back
  e.state = State::Evicted;
  e.file_prefetch_asked = false;
  ++counters_.evictions;
  counters_.evicted_bytes += e.bytes;
  counters_.working_set_evictions += e.hot;
}

uint64_t SpillManager::reclaim(uint64_t bytes) {
  if (reclaiming_) return 0;
  reclaiming_ = true;
  struct Reset {
    bool& flag;
    ~Reset() { flag = false; }
  } reset{reclaiming_};
  pressured_ = true;
  // The step before freed nothing; this one needs room after all: copies
  // ahead cover it again until the step ends.
  if (ahead_limit_ == 0) ahead_limit_ = UINT64_MAX;
  ++counters_.reclaims;
  if (spdlog::should_log(spdlog::level::debug)) {
    const engine::AllocatorStats st = allocator_->stats();
    spdlog::debug("spill: reclaim of {} asked{}; the job's allocator has {} in use, {} cached",
                  format_bytes(bytes), E::in_backward() ? " in backward" : "",
                  format_bytes(st.in_use_bytes), format_bytes(st.cached_bytes));
  }
  uint64_t freed = 0;
  // Oldest first: those already copied out cost nothing to free.
  for (auto& [seq, e] : entries_) {
    if (freed >= bytes) break;
    if (evictable(e) && e.state == State::Stored && store_->copied(seq)) {
      freed += e.bytes;
      evict(e);
    }
  }
  // Then copies of the next oldest, all started before waiting for any.
  std::vector<uint64_t> started;
  uint64_t pending = 0;
  for (auto& [seq, e] : entries_) {
    if (freed + pending >= bytes) break;
    if (!evictable(e)) continue;
    if (e.state == State::Resident) start_copy(seq, e);
    started.push_back(seq);
    pending += e.bytes;
  }
  for (uint64_t seq : started) {
    Entry& e = entries_.at(seq);
    if (Status st = store_->wait_copied(seq); !st.ok()) fail(e, "spill", st);
    freed += e.bytes;
    evict(e);
  }
  // Last, tensors brought back ahead of time: the store still has them.
  for (auto& [seq, e] : entries_) {
    if (freed >= bytes) break;
    if (e.state == State::Restoring && e.storage.use_count() == 1) {
      if (e.restore_fence) e.restore_fence->wait();
      e.restore_fence.reset();
      freed += e.bytes;
      evict(e);
    }
  }
  if (freed < bytes) {
    // What stays on the device: saved tensors the step holds elsewhere too
    // (in use now), and what the allocator holds besides saved tensors.
    uint64_t held = 0, in_use = 0, in_use_backward = 0;
    size_t held_n = 0;
    bool hot = false;
    for (const auto& [seq, e] : entries_) {
      if (!e.storage) continue;
      held += e.bytes;
      ++held_n;
      hot = hot || e.hot;
      if (e.storage.use_count() > 1) {
        in_use += e.bytes;
        if (e.hot) in_use_backward += e.bytes;
      }
    }
    last_shortfall_in_recomputed_backward_ = E::in_backward() && hot;
    spdlog::debug("spill: freed {} of {} asked; {} saved tensors on the device ({}), {} of "
                  "them in use by the step ({} saved during backward); the job's allocator "
                  "has {} in use",
                  format_bytes(freed), format_bytes(bytes), held_n, format_bytes(held),
                  format_bytes(in_use), format_bytes(in_use_backward),
                  format_bytes(allocator_->stats().in_use_bytes));
  }
  return freed;
}

void SpillManager::offload_ahead() {
  uint64_t budget = allocator_->budget();
  if (!budget) return;
  uint64_t in_use = allocator_->stats().in_use_bytes;
  uint64_t mark = static_cast<uint64_t>(policy_.offload_mark * static_cast<double>(budget));
  if (in_use <= mark) return;
  uint64_t excess = std::min(in_use - mark, ahead_limit_), covered = 0;
  for (const auto& [seq, e] : entries_) {
    if (e.storage && e.state == State::Stored) covered += e.bytes;
  }
  for (auto& [seq, e] : entries_) {
    if (covered >= excess) break;
    if (evictable(e) && e.state == State::Resident && !e.hot) {
      // Only ahead of need: a store that cannot take it now (full) fails
      // the job only if a reclaim needs the room.
      if (Status st = store_->put(seq, e.storage->data(), e.bytes, e.name); !st.ok()) {
        spdlog::debug("spill: not copying {} ahead: {}", e.name, st.to_string());
        return;
      }
      e.stored = true;
      e.state = State::Stored;
      covered += e.bytes;
    }
  }
}

void SpillManager::end_step() {
  const uint64_t freed = counters_.evicted_bytes - at_step_start_.evicted_bytes;
  if (counters_.reclaims == at_step_start_.reclaims) pressured_ = false;
  // A quarter more than the step freed: a step's need varies a little (the
  // last batch of an epoch, a Shrink), and a copy ahead that is not needed
  // only costs link time.
  ahead_limit_ = freed + freed / 4;
  last_step_spilled_ = counters_.evictions > at_step_start_.evictions;
  last_step_spilled_bytes_ = freed;
  last_step_spilled_working_set_ =
      counters_.working_set_evictions > at_step_start_.working_set_evictions;
  at_step_start_ = counters_;
}

void SpillManager::ensure_resident(uint64_t seq, Entry& e) {
  if (e.state == State::Restoring) {
    if (e.restore_fence) transfer_->compute_waits(e.restore_fence);
    e.restore_fence.reset();
    e.state = State::Stored;  // on the device, and still in the store
    ++counters_.prefetched;
    return;
  }
  if (e.storage) return;
  // The allocation may spill older entries to make room; this one is
  // evicted, so it is never among them.
  auto storage = std::make_shared<E::Storage>(e.bytes, allocator_);
  if (Status st = store_->get(seq, storage->data()); !st.ok()) {
    settle_copies();  // some chunks may be on their way into `storage`
    fail(e, "restore", st);
  }
  e.storage = std::move(storage);
  resident_.emplace(e.storage.get(), seq);
  e.state = State::Stored;
  ++counters_.restores;
  counters_.restored_bytes += e.bytes;
}

void SpillManager::prefetch_before(uint64_t seq, uint64_t in_use_bytes) {
  // Backward needs the entries saved before this one next, newest first:
  // the nearest `lookahead` come back to the device if they are off it (and
  // the memory is free without spilling anything, with the headroom of the
  // policy left), the `file_lookahead` after them from the file into host
  // memory.
  int position = 0;
  bool device_room = true;
  for (auto it = std::make_reverse_iterator(entries_.find(seq));
       it != entries_.rend() && position < policy_.lookahead + policy_.file_lookahead; ++it) {
    auto& [s, e] = *it;
    ++position;
    if (e.state != State::Evicted) continue;
    if (position <= policy_.lookahead && device_room) {
      uint64_t budget = allocator_->budget();
      uint64_t headroom = static_cast<uint64_t>(policy_.prefetch_headroom * in_use_bytes);
      if (budget && allocator_->stats().in_use_bytes + e.bytes + headroom > budget) {
        device_room = false;
      } else if (auto storage = E::Storage::if_free(e.bytes, allocator_)) {
        std::shared_ptr<Fence> done;
        if (Status st = store_->get_async(s, storage->data(), &done); !st.ok()) {
          settle_copies();
          fail(e, "restore", st);
        }
        e.storage = std::move(storage);
        resident_.emplace(e.storage.get(), s);
        e.restore_fence = std::move(done);
        e.state = State::Restoring;
        ++counters_.restores;
        counters_.restored_bytes += e.bytes;
        continue;
      }
      device_room = false;  // not without spilling: it comes back when needed
    }
    if (!e.file_prefetch_asked) {
      e.file_prefetch_asked = true;
      store_->prefetch(s);
    }
  }
}

void SpillManager::settle_copies() noexcept {
  try {
    transfer_->mark()->wait();
  } catch (const std::exception& ex) {
    spdlog::error("spill: waiting for the copy stream: {}", ex.what());
  }
}

void SpillManager::drop_handle(uint64_t seq) noexcept {
  auto it = entries_.find(seq);
  if (it == entries_.end() || --it->second.handles > 0) return;
  Entry& e = it->second;
  try {
    // A copy back into this storage may still be running: later compute
    // work (a new owner of the memory) must not overtake it.
    if (e.restore_fence) transfer_->compute_waits(e.restore_fence);
  } catch (const std::exception& ex) {
    spdlog::error("spill: dropping {}: {}", e.name, ex.what());
  }
  if (e.storage) resident_.erase(e.storage.get());
  if (e.stored) store_->erase(seq);
  entries_.erase(it);
}

}  // namespace leasehold::spill
