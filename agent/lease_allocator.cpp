#include "agent/lease_allocator.h"

#include <algorithm>

#include "agent/engine/cuda_context.h"
#include "shared/units.h"

namespace leasehold {

LeaseAllocatorOptions LeaseAllocatorOptions::for_budget(uint64_t budget) {
  LeaseAllocatorOptions o;
  o.budget_bytes = budget;
  if (budget) o.lease_bytes = std::clamp<uint64_t>(budget / 8, 2ull << 20, 32ull << 20);
  return o;
}

namespace {

PagedResourceOptions paged_options(const AgentSession& session, const LeaseAllocatorOptions& o) {
  PagedResourceOptions p;
  p.pages.budget_bytes = o.budget_bytes;
  p.pages.lease_bytes = o.lease_bytes;
  p.pages.lease_wait = o.lease_wait;
  p.pages.guaranteed_bytes = o.guaranteed_bytes;
  p.pages.guaranteed_wait = o.guaranteed_wait;
  p.pages.growth_backoff = o.growth_backoff;
  p.small_limit = o.small_limit;
  p.granularity = o.granularity;
  // The engine's streams and its copy streams all end at the device fence.
  const engine::Device device = pool_device(session.pool());
  p.fence = [fence = o.fence, device](const std::vector<StreamRef>&) {
    if (fence) return fence();
    engine::fence_device(device);
  };
  return p;
}

}  // namespace

LeaseAllocator::LeaseAllocator(AgentSession& session, LeaseAllocatorOptions options)
    : paged_(session, paged_options(session, options)),
      budget_(paged_, options.budget_bytes, options.granularity),
      reclaiming_(budget_, [this](uint64_t bytes, std::string& why_not) {
        return reclaim(bytes, why_not);
      }),
      counted_(reclaiming_) {}

bool LeaseAllocator::reclaim(uint64_t bytes, std::string& why_not) {
  engine::Reclaimer spill, idle;
  {
    std::lock_guard lock(mu_);
    spill = reclaimer_;
    idle = idle_release_;
  }
  if (idle && idle(bytes) > 0) return true;
  if (spill && spill(bytes) > 0) return true;
  // Nothing (more) to spill: growth past the guaranteed share may wait for
  // the coordinator rather than the job failing, unless what is live
  // leaves no room for the request within the budget anyway.
  if (budget_.has_room_for(bytes) && paged_.allow_patient_growth()) return true;
  if (spill) why_not = "nothing more could be spilled";
  return false;
}

StreamRef LeaseAllocator::stream(bool make) const {
#ifdef LEASEHOLD_HAVE_CUDA
  const engine::Device d = paged_.device();
  if (d.is_cuda()) {
    return make ? engine::compute_stream(d.index) : engine::existing_compute_stream(d.index);
  }
#else
  (void)make;
#endif
  return nullptr;
}

void* LeaseAllocator::allocate(size_t bytes) {
  try {
    return counted_.allocate(bytes, stream(true));
  } catch (const OutOfMemoryError&) {
    paged_.disarm_patient_growth();  // armed for this allocation only
    throw;
  }
}

void* LeaseAllocator::allocate_if_free(size_t bytes) {
  if (bytes == 0) return nullptr;
  return counted_.allocate_if_free(bytes, stream(true));
}

void LeaseAllocator::deallocate(void* ptr, size_t bytes) noexcept {
  counted_.deallocate(ptr, bytes, stream(false));
}

void LeaseAllocator::set_reclaimer(engine::Reclaimer reclaimer) {
  std::lock_guard lock(mu_);
  reclaimer_ = std::move(reclaimer);
}

void LeaseAllocator::set_idle_release(engine::Reclaimer release) {
  std::lock_guard lock(mu_);
  idle_release_ = std::move(release);
}

engine::AllocatorStats LeaseAllocator::stats() const {
  const StatisticsAdaptor::Counts c = counted_.counts();
  const PagedResource::Stats p = paged_.stats();
  engine::AllocatorStats s;
  s.in_use_bytes = c.in_use_bytes;
  s.peak_in_use_bytes = c.peak_in_use_bytes;
  s.allocations = c.allocations;
  s.cached_bytes = p.held_bytes - std::min(p.held_bytes, p.live_bytes);
  s.leases = p.leases;
  s.peak_leased_bytes = p.peak_held_bytes;
  s.pages_mapped = p.pages_mapped;
  s.trims = p.trims;
  return s;
}

void LeaseAllocator::empty_cache() { paged_.release_cached(); }

void LeaseAllocator::reuse_idle(size_t bytes) { paged_.make_room(bytes); }

}  // namespace leasehold
