#include "agent/lease_allocator.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "agent/engine/cuda_context.h"
#include "shared/units.h"

namespace leasehold {

LeaseAllocator::LeaseAllocator(AgentSession& session, LeaseAllocatorOptions options)
    : session_(session), opt_(options) {
  if (!is_power_of_two(opt_.granularity) || opt_.granularity < 256) {
    throw std::invalid_argument("lease allocator granularity must be a power of two >= 256");
  }
  PoolDescriptor pool = session_.pool();
  device_ = pool.backend == Backend::Cuda ? engine::Device::cuda(pool.device)
                                          : engine::Device::cpu();
}

LeaseAllocator::~LeaseAllocator() {
  std::lock_guard lock(mu_);
  if (!placements_.empty()) {
    spdlog::error("lease allocator destroyed with {} allocations ({}) still in use",
                  placements_.size(), format_bytes(in_use_));
  }
  if (!segments_.empty()) {
    try {
      fence();
    } catch (const std::exception& e) {
      // The device faulted; nothing queued will run any more.
      spdlog::error("lease allocator: waiting for device work before releasing leases: {}",
                    e.what());
    }
  }
  // Segment destructors release their leases.
}

void LeaseAllocator::fence() {
  if (opt_.fence) return opt_.fence();
  engine::fence_device(device_);
}

void* LeaseAllocator::place(Segment& seg, uint64_t need) {
  auto b = seg.blocks.allocate(need, PoolAllocator::End::Low);
  if (!b) return nullptr;
  void* p = seg.lease.data() + b->offset;
  placements_[p] = Placement{&seg, b->offset, b->size};
  in_use_ += b->size;
  peak_ = std::max(peak_, in_use_);
  ++allocations_;
  return p;
}

void* LeaseAllocator::try_segments(uint64_t need, bool small) {
  for (auto& seg : segments_) {
    if (seg.small != small || seg.lease.lost() || seg.blocks.largest_free() < need) continue;
    if (void* p = place(seg, need)) return p;
  }
  return nullptr;
}

size_t LeaseAllocator::release_free_segments() {
  bool any = std::any_of(segments_.begin(), segments_.end(),
                         [](const Segment& s) { return s.blocks.used_block_count() == 0; });
  if (!any) return 0;
  fence();
  size_t n = 0;
  for (auto it = segments_.begin(); it != segments_.end();) {
    if (it->blocks.used_block_count() == 0) {
      leased_ -= it->lease.size();
      it = segments_.erase(it);  // ~Lease releases it
      ++n;
    } else {
      ++it;
    }
  }
  return n;
}

[[noreturn]] void LeaseAllocator::out_of_memory(uint64_t bytes, const std::string& why) {
  throw engine::OutOfMemoryError(
      "out of memory: cannot allocate " + format_bytes(bytes) + " (" + why + "; in use " +
          format_bytes(in_use_) + ", cached " + format_bytes(leased_ - in_use_) + ", budget " +
          (opt_.budget_bytes ? format_bytes(opt_.budget_bytes) : std::string("none")) + ")",
      bytes);
}

LeaseAllocator::Segment& LeaseAllocator::grow(uint64_t need, bool small) {
  PoolDescriptor pool = session_.pool();
  uint64_t size = small ? opt_.small_segment : std::max(opt_.large_segment, need);
  size = align_up(size, pool.alignment);
  for (int attempt = 0; attempt < 2; ++attempt) {
    if (opt_.budget_bytes && leased_ + size > opt_.budget_bytes) {
      // Shrink the request to what the budget allows, if that still fits.
      uint64_t room = opt_.budget_bytes - std::min(opt_.budget_bytes, leased_);
      uint64_t fitted = align_down(room, pool.alignment);
      if (fitted >= need) {
        size = fitted;
      } else if (attempt == 0 && release_free_segments() > 0) {
        continue;
      } else {
        out_of_memory(need, "the job's memory budget is exhausted");
      }
    }
    try {
      Lease lease = session_.acquire(size, LeaseEnd::High, opt_.lease_wait);
      leased_ += lease.size();
      segments_.emplace_back(std::move(lease), opt_.granularity, small);
      return segments_.back();
    } catch (const Error& e) {
      if (attempt == 0 && release_free_segments() > 0) continue;
      out_of_memory(need, std::string("the coordinator refused a lease of ") + format_bytes(size) +
                              ": " + e.what());
    }
  }
  out_of_memory(need, "no lease could be obtained");
}

void* LeaseAllocator::allocate(size_t bytes) {
  if (bytes == 0) throw std::invalid_argument("allocation of 0 bytes");
  uint64_t need = align_up(bytes, opt_.granularity);
  if (need == 0) out_of_memory(bytes, "size overflows");
  bool small = need <= opt_.small_limit;
  std::lock_guard lock(mu_);
  if (void* p = try_segments(need, small)) return p;
  void* p = place(grow(need, small), need);
  if (!p) out_of_memory(bytes, "a fresh lease could not hold it");
  return p;
}

void LeaseAllocator::deallocate(void* ptr, size_t) noexcept {
  std::lock_guard lock(mu_);
  auto it = placements_.find(ptr);
  if (it == placements_.end()) {
    spdlog::error("lease allocator: free of unknown pointer {}", ptr);
    return;
  }
  it->second.segment->blocks.free(it->second.offset);
  in_use_ -= it->second.size;
  placements_.erase(it);
}

engine::AllocatorStats LeaseAllocator::stats() const {
  std::lock_guard lock(mu_);
  engine::AllocatorStats s;
  s.in_use_bytes = in_use_;
  s.peak_in_use_bytes = peak_;
  s.cached_bytes = leased_ - in_use_;
  s.allocations = allocations_;
  s.leases = segments_.size();
  return s;
}

void LeaseAllocator::empty_cache() {
  std::lock_guard lock(mu_);
  release_free_segments();
}

}  // namespace leasehold
