// The block cache's facade (block_cache.h): the allocation policy that
// tries each source of memory in turn, free and record_stream, trim, and the
// statistics. Where memory comes from and when it may be reused are the
// parts' jobs (block_cache_state.h lists them).
#include "torch_plugin/block_cache.h"

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <utility>

#include "torch_plugin/block_cache_state.h"
#include "torch_plugin/rounding.h"

namespace leasehold::torch_plugin {

using detail::Block;
using detail::BState;
using detail::round_up;
using detail::Segment;

std::string format_bytes(uint64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  char buf[32];
  if (bytes < 1024) {
    std::snprintf(buf, sizeof buf, "%" PRIu64 " B", bytes);
    return buf;
  }
  double v = static_cast<double>(bytes) / 1024;
  int unit = 0;
  while (v >= 1024 && unit < 3) {
    v /= 1024;
    ++unit;
  }
  std::snprintf(buf, sizeof buf, "%.2f %s", v, kUnits[unit]);
  return buf;
}

// ---- the allocation policy ------------------------------------------------------

void* BlockCache::State::hand_out(Block* b, uint64_t size, StreamId stream, bool capturing,
                                  bool hit) {
  pool.take(b, size, stream, capturing);
  live.emplace(b->addr, b);
  in_use_bytes += b->size;
  peak_in_use_bytes = std::max(peak_in_use_bytes, in_use_bytes);
  ++allocations;
  if (hit) ++cache_hits;
  return reinterpret_cast<void*>(b->addr);
}

// Cheapest first: a cached block; blocks other streams freed, once a fresh
// event shows their work done (an idle stream's completes at once); a new
// lease; waiting for every stream's free blocks; giving cached segments back
// and unbacking free pages to make room for a lease. A capture tries only the first and the lease:
// it must not record events nor wait. After each step that released the
// lock the cache is searched again: other threads may have freed meanwhile.
void* BlockCache::State::allocate(std::unique_lock<std::mutex>& lk, uint64_t bytes, uint64_t size,
                                  bool small, StreamId stream, bool capturing) {
  order.saw(stream);
  if (capturing) {
    graphs.saw_capture(stream);
  } else if (order.has_pending()) {
    order.process_events();
  }
  if (Block* b = pool.best_fit(small, size, stream, capturing)) {
    return hand_out(b, size, stream, capturing, true);
  }
  if (!capturing && order.start_migrations(small, size, stream)) {
    order.process_events();  // an idle stream's event completes at once
    if (Block* b = pool.best_fit(small, size, stream, capturing)) {
      return hand_out(b, size, stream, capturing, true);
    }
  }
  std::string refusal;
  const uint64_t need = round_up(size, opt.lease_alignment);
  const bool never = need == 0 || (opt.budget_bytes && need > opt.budget_bytes);
  if (!never) {
    if (Block* b = leases.lease_segment(lk, size, small, false, false, &refusal)) {
      return hand_out(b, size, stream, capturing, false);
    }
    if (Block* b = pool.best_fit(small, size, stream, capturing)) {  // freed meanwhile
      return hand_out(b, size, stream, capturing, true);
    }
  }
  if (!never && !capturing) {
    if (order.drain(lk, small, stream)) {
      if (Block* b = pool.best_fit(small, size, stream, capturing)) {
        return hand_out(b, size, stream, capturing, true);
      }
    }
    // Give back cached segments: enough for the budget to admit the
    // lease, or (the source refused) everything. Then, a paging source,
    // free pages of partly used segments: enough for the budget, or (the
    // source refused) the whole request, which they then back.
    uint64_t give_back = UINT64_MAX;
    if (refusal.empty()) {
      uint64_t r = leases.room();
      give_back = need > r ? need - r : 0;
    }
    leases.release_segments(lk, give_back);
    if (uint64_t r = leases.room(); leases.page_size() && (!refusal.empty() || need > r)) {
      order.drain_all(lk);  // the device must be done with pages before they go
      const uint64_t room = leases.room();  // others may have freed meanwhile
      leases.unback_free(!refusal.empty() ? need : need > room ? need - room : 0);
    }
    if (Block* b = leases.lease_segment(lk, size, small, pool.free_segments().empty(),
                                        !refusal.empty(), &refusal)) {
      return hand_out(b, size, stream, capturing, false);
    }
    if (Block* b = pool.best_fit(small, size, stream, capturing)) {
      return hand_out(b, size, stream, capturing, true);
    }
  }
  ++failed_allocations;
  std::string msg = "leasehold: cannot allocate " + format_bytes(bytes) + ": " +
                    format_bytes(in_use_bytes) + " in use, " +
                    format_bytes(leases.leased_bytes() - in_use_bytes) + " cached, budget " +
                    (opt.budget_bytes ? format_bytes(opt.budget_bytes) : std::string("none"));
  if (!refusal.empty()) msg += "; a lease was refused: " + refusal;
  if (capturing) msg += "; during CUDA graph capture cached blocks are not reused";
  throw OutOfMemory(msg);
}

// ---- BlockCache -----------------------------------------------------------------

BlockCache::BlockCache(LeaseSource& leases, StreamOps& streams, BlockCacheOptions options)
    : leases_(leases), streams_(streams), opt_(options) {
  if (opt_.lease_alignment == 0) throw std::invalid_argument("block cache: lease alignment 0");
  if (opt_.granularity == 0 || (opt_.granularity & (opt_.granularity - 1)) != 0) {
    throw std::invalid_argument("block cache: granularity must be a power of two");
  }
  if (opt_.small_limit == 0 || opt_.small_segment < opt_.small_limit) {
    throw std::invalid_argument("block cache: a small segment must hold a small block");
  }
  s_ = std::make_unique<State>(leases_, streams_, opt_);
}

BlockCache::~BlockCache() {
  std::unique_lock lk(mu_);
  State& s = *s_;
  try {
    // Wait for the work queued on every stream seen, so no lease goes back
    // with a kernel still writing into it.
    std::vector<StreamId> targets;
    for (StreamId st : s.order.known_streams()) {
      if (!s.streams.capturing(st)) targets.push_back(st);
    }
    auto evs = detail::record_each(s.streams, targets);
    for (const auto& r : evs) s.streams.wait(r.event);
    detail::destroy_all(s.streams, evs);
  } catch (...) {
    // The device failed; nothing queued runs any more.
  }
  s.order.abandon_events();
  s.leases.release_all();
  // The segments' and blocks' objects go with the pool.
}

void* BlockCache::allocate(uint64_t bytes, StreamId stream) {
  if (bytes == 0) throw std::invalid_argument("leasehold: allocation of 0 bytes");
  uint64_t size = round_up(bytes, opt_.granularity);
  bool small = size != 0 && size <= opt_.small_limit;
  bool capturing = streams_.capturing(stream);
  std::unique_lock lk(mu_);
  if (size == 0) {
    ++s_->failed_allocations;
    throw OutOfMemory("leasehold: cannot allocate " + std::to_string(bytes) + " bytes");
  }
  try {
    return s_->allocate(lk, bytes, size, small, stream, capturing);
  } catch (const OutOfMemory&) {
    // Pages unbacked for it and not used hold no segment's memory: the
    // coordinator gets them back rather than the job keeping them.
    if (lk.owns_lock()) lk.unlock();
    leases_.give_back_unused();
    throw;
  }
}

// A block freed on its own stream is reusable by that stream at once; kept
// aside when a capture was involved; waiting for events when record_stream
// named other streams.
void BlockCache::free(void* ptr) {
  std::unique_lock lk(mu_);
  State& s = *s_;
  auto it = s.live.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.live.end()) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "leasehold: free of %p, which this allocator did not hand out",
                  ptr);
    throw std::invalid_argument(buf);
  }
  Block* b = it->second;
  bool capturing = streams_.capturing(b->stream);
  std::vector<StreamId> uses;
  for (StreamId u : b->uses) {
    if (u == b->stream) continue;
    capturing = capturing || streams_.capturing(u);
    uses.push_back(u);
  }
  s.live.erase(it);
  s.in_use_bytes -= b->size;
  b->free_seq = s.order.stamp_free();
  if (b->captured || capturing) {
    if (capturing) s.graphs.saw_capture(b->stream);
    s.graphs.hold(b);
    return;
  }
  if (!uses.empty()) {
    try {
      s.order.await_users(b, uses);
    } catch (...) {
      // Not knowing when its users finish, it is never reused (until
      // empty_cache waits for every stream).
      s.graphs.hold(b);
      throw;
    }
    return;
  }
  s.pool.make_free(b, false);
}

void BlockCache::record_stream(void* ptr, StreamId stream) {
  std::unique_lock lk(mu_);
  State& s = *s_;
  auto it = s.live.find(reinterpret_cast<uintptr_t>(ptr));
  if (it == s.live.end()) {
    char buf[112];
    std::snprintf(buf, sizeof buf,
                  "leasehold: record_stream on %p, which this allocator did not hand out", ptr);
    throw std::invalid_argument(buf);
  }
  Block* b = it->second;
  s.order.saw(stream);
  if (stream == b->stream) return;
  if (std::find(b->uses.begin(), b->uses.end(), stream) == b->uses.end()) {
    b->uses.push_back(stream);
  }
}

uint64_t BlockCache::trim(uint64_t bytes) {
  uint64_t done = 0;
  {
    std::unique_lock lk(mu_);
    if (s_->order.has_pending()) s_->order.process_events();
    done = s_->leases.release_segments(lk, bytes);
    if (done < bytes && s_->leases.page_size()) {
      s_->order.drain_all(lk);
      done += s_->leases.unback_free(bytes - done);
    }
  }
  leases_.give_back_unused();
  return done;
}

uint64_t BlockCache::empty_cache() {
  uint64_t done = 0;
  {
    std::unique_lock lk(mu_);
    if (s_->order.has_pending()) s_->order.process_events();
    s_->graphs.return_held(lk);
    done = s_->leases.release_segments(lk, UINT64_MAX);
    if (s_->leases.page_size()) {
      s_->order.drain_all(lk);
      done += s_->leases.unback_free(UINT64_MAX);
    }
  }
  leases_.give_back_unused();
  return done;
}

// ---- statistics and inspection ----------------------------------------------------

BlockCacheStats BlockCache::stats() const {
  std::lock_guard lk(mu_);
  const State& s = *s_;
  BlockCacheStats st;
  st.leased_bytes = s.leases.leased_bytes();
  st.peak_leased_bytes = s.leases.peak_leased_bytes();
  st.in_use_bytes = s.in_use_bytes;
  st.peak_in_use_bytes = s.peak_in_use_bytes;
  st.allocations = s.allocations;
  st.cache_hits = s.cache_hits;
  st.lease_requests = s.leases.lease_requests();
  st.failed_allocations = s.failed_allocations;
  st.segments = s.pool.segments().size();
  st.held_bytes = s.graphs.held_bytes();
  st.unbacked_bytes = s.leases.unbacked_bytes();
  st.unbacks = s.leases.unbacks();
  st.budget_bytes = opt_.budget_bytes;
  return st;
}

uint64_t BlockCache::block_size(const void* ptr) const {
  std::lock_guard lk(mu_);
  auto it = s_->live.find(reinterpret_cast<uintptr_t>(ptr));
  return it == s_->live.end() ? 0 : it->second->size;
}

std::vector<SegmentInfo> BlockCache::segments() const {
  std::lock_guard lk(mu_);
  std::vector<SegmentInfo> out;
  for (Segment* seg : s_->pool.segments()) {
    SegmentInfo si;
    si.base = reinterpret_cast<uintptr_t>(seg->lease.base);
    si.size = seg->lease.size;
    si.small = seg->small;
    for (Block* b = seg->first; b; b = b->next) {
      si.blocks.push_back({b->addr, b->size, b->state, b->ready, b->stream});
    }
    out.push_back(std::move(si));
  }
  std::sort(out.begin(), out.end(),
            [](const SegmentInfo& a, const SegmentInfo& b) { return a.base < b.base; });
  return out;
}

std::string BlockCache::check_invariants() const {
  std::lock_guard lk(mu_);
  return s_->check();
}

}  // namespace leasehold::torch_plugin
