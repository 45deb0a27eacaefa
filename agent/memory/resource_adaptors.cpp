#include "agent/memory/resource_adaptors.h"

#include <algorithm>
#include <stdexcept>

#include "shared/units.h"

namespace leasehold {

// ---- BudgetAdaptor ----

BudgetAdaptor::BudgetAdaptor(MemoryResource& upstream, uint64_t budget, uint64_t granularity)
    : upstream_(upstream), budget_(budget), granularity_(granularity) {}

bool BudgetAdaptor::fits(uint64_t bytes, uint64_t need) const {
  if (!budget_) return true;
  if (need == 0 || need > budget_) {
    throw OutOfMemoryError("out of memory: cannot allocate " + format_bytes(bytes) +
                               ": one tensor larger than the job's whole memory budget (" +
                               format_bytes(budget_) + ")",
                           bytes, true);
  }
  return live_ <= budget_ - need;
}

void* BudgetAdaptor::allocate(uint64_t bytes, StreamRef stream) {
  if (bytes == 0) throw std::invalid_argument("allocation of 0 bytes");
  const uint64_t need = align_up(bytes, granularity_);
  {
    std::lock_guard lock(mu_);
    if (!fits(bytes, need)) {
      throw OutOfMemoryError("out of memory: cannot allocate " + format_bytes(bytes) +
                                 ": the job's memory budget is exhausted (in use " +
                                 format_bytes(live_) + ", budget " + format_bytes(budget_) + ")",
                             bytes);
    }
    live_ += need;  // taken before asking upstream: another thread cannot take it too
  }
  try {
    return upstream_.allocate(bytes, stream);
  } catch (...) {
    std::lock_guard lock(mu_);
    live_ -= need;
    throw;
  }
}

void* BudgetAdaptor::allocate_if_free(uint64_t bytes, StreamRef stream) {
  const uint64_t need = align_up(bytes, granularity_);
  {
    std::lock_guard lock(mu_);
    if (budget_ && (need == 0 || need > budget_ || live_ > budget_ - need)) return nullptr;
    live_ += need;
  }
  void* p = nullptr;
  try {
    p = upstream_.allocate_if_free(bytes, stream);
  } catch (...) {
    p = nullptr;
  }
  if (!p) {
    std::lock_guard lock(mu_);
    live_ -= need;
  }
  return p;
}

void BudgetAdaptor::deallocate(void* p, uint64_t bytes, StreamRef stream) noexcept {
  upstream_.deallocate(p, bytes, stream);
  std::lock_guard lock(mu_);
  live_ -= std::min(live_, align_up(bytes, granularity_));
}

bool BudgetAdaptor::has_room_for(uint64_t bytes) const {
  const uint64_t need = align_up(bytes, granularity_);
  std::lock_guard lock(mu_);
  return !budget_ || (need != 0 && need <= budget_ && live_ <= budget_ - need);
}

uint64_t BudgetAdaptor::live_bytes() const {
  std::lock_guard lock(mu_);
  return live_;
}

// ---- ReclaimingAdaptor ----

ReclaimingAdaptor::ReclaimingAdaptor(MemoryResource& upstream, Reclaim reclaim)
    : upstream_(upstream), reclaim_(std::move(reclaim)) {}

void* ReclaimingAdaptor::allocate(uint64_t bytes, StreamRef stream) {
  for (;;) {
    try {
      return upstream_.allocate(bytes, stream);
    } catch (const OutOfMemoryError& e) {
      if (e.permanent() || !reclaim_) throw;
      std::string why_not;
      if (reclaim_(bytes, why_not)) continue;
      if (why_not.empty()) throw;
      throw OutOfMemoryError(std::string(e.what()) + "; " + why_not, e.requested());
    }
  }
}

// ---- StatisticsAdaptor ----

void StatisticsAdaptor::count(uint64_t bytes) {
  counts_.in_use_bytes += bytes;
  counts_.peak_in_use_bytes = std::max(counts_.peak_in_use_bytes, counts_.in_use_bytes);
  ++counts_.allocations;
}

void* StatisticsAdaptor::allocate(uint64_t bytes, StreamRef stream) {
  void* p = upstream_.allocate(bytes, stream);
  std::lock_guard lock(mu_);
  count(bytes);
  return p;
}

void* StatisticsAdaptor::allocate_if_free(uint64_t bytes, StreamRef stream) {
  void* p = upstream_.allocate_if_free(bytes, stream);
  if (p) {
    std::lock_guard lock(mu_);
    count(bytes);
  }
  return p;
}

void StatisticsAdaptor::deallocate(void* p, uint64_t bytes, StreamRef stream) noexcept {
  upstream_.deallocate(p, bytes, stream);
  std::lock_guard lock(mu_);
  counts_.in_use_bytes -= std::min(counts_.in_use_bytes, bytes);
}

StatisticsAdaptor::Counts StatisticsAdaptor::counts() const {
  std::lock_guard lock(mu_);
  return counts_;
}

}  // namespace leasehold
