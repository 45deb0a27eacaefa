#include "agent/spill/host_tier.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>

#include "agent/engine/cuda_context.h"
#include "shared/units.h"

namespace leasehold::spill {

HostTier::HostTier(char* base, uint64_t bytes, uint64_t limit, uint64_t alignment)
    : base_(base), pool_(bytes, alignment) {
  limit_ = limit ? std::min<uint64_t>(limit, pool_.pool_size()) : pool_.pool_size();
}

std::optional<uint64_t> HostTier::allocate(uint64_t bytes, PoolAllocator::End end) {
  std::lock_guard lock(mu_);
  const uint64_t need = pool_.round_up(bytes);
  if (need == 0 || pool_.used_bytes() + need > limit_) return std::nullopt;
  const auto block = pool_.allocate(bytes, end);
  if (!block) return std::nullopt;
  return block->offset;
}

void HostTier::free(uint64_t offset) {
  std::lock_guard lock(mu_);
  pool_.free(offset);
}

void HostTier::free_after(uint64_t offset, std::shared_ptr<Fence> copies) {
  std::lock_guard lock(mu_);
  pool_.free(offset);
  if (copies && !copies->done()) copies_.push_back(std::move(copies));
}

void HostTier::wait_for_copies() {
  std::vector<std::shared_ptr<Fence>> copies;
  {
    std::lock_guard lock(mu_);
    copies.swap(copies_);
  }
  // (Outside the lock: a spill may free and take ranges meanwhile.)
  for (const auto& f : copies) f->wait();
}

uint64_t HostTier::largest_free() const {
  std::lock_guard lock(mu_);
  return pool_.largest_free();
}

uint64_t HostTier::used_bytes() const {
  std::lock_guard lock(mu_);
  return pool_.used_bytes();
}

HostTierAllocator::HostTierAllocator(std::shared_ptr<HostTier> tier, engine::Device device)
    : tier_(std::move(tier)), device_(device) {}

void* HostTierAllocator::allocate(size_t bytes) {
  tier_->wait_for_copies();
  const auto offset = tier_->allocate(bytes, PoolAllocator::End::High);
  if (!offset) {
    throw engine::OutOfMemoryError(
        "the host tier has no room for " + format_bytes(bytes) + " of page-locked memory (" +
            format_bytes(tier_->used_bytes()) + " of its " + format_bytes(tier_->limit()) +
            " in use, the longest free run " + format_bytes(tier_->largest_free()) +
            "; --spill-host-bytes, or the job's spill.host_bytes, sets it)",
        bytes);
  }
  std::lock_guard lock(mu_);
  stats_.in_use_bytes += bytes;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  ++stats_.allocations;
  return tier_->data(*offset);
}

void HostTierAllocator::deallocate(void* ptr, size_t bytes) noexcept {
  try {
    engine::fence_device(device_);
  } catch (const std::exception& e) {
    std::lock_guard lock(mu_);
    if (!lost_) {
      spdlog::error("host tier: page-locked memory freed from now on stays out of the tier "
                    "(the first: {}): waiting for the device failed: {}",
                    format_bytes(bytes), e.what());
      lost_ = true;
    }
    return;
  }
  {
    std::lock_guard lock(mu_);
    stats_.in_use_bytes -= bytes;
  }
  try {
    tier_->free(static_cast<uint64_t>(static_cast<char*>(ptr) - tier_->data(0)));
  } catch (const std::exception& e) {
    spdlog::critical("host tier: freeing memory it never gave: {}", e.what());
  }
}

engine::AllocatorStats HostTierAllocator::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace leasehold::spill
