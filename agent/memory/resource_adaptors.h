// Adaptors around a MemoryResource (memory_resource.h), each adding one
// thing, as RMM's *_resource_adaptor do: a budget on live bytes, a
// reclaimer asked before an allocation fails, and statistics. Each holds a
// reference to its upstream, which must outlive it. Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <string>

#include "agent/memory/memory_resource.h"

namespace leasehold {

// Refuses an allocation that would take the live bytes (each allocation
// rounded up to `granularity`) past `budget`: what a job may hold at once,
// said in the job's terms before the upstream is asked (which counts pages:
// paged_resource.h). budget 0: none.
class BudgetAdaptor final : public MemoryResource {
 public:
  BudgetAdaptor(MemoryResource& upstream, uint64_t budget, uint64_t granularity);
  void* allocate(uint64_t bytes, StreamRef stream) override;
  void deallocate(void* p, uint64_t bytes, StreamRef stream) noexcept override;
  void* allocate_if_free(uint64_t bytes, StreamRef stream) override;
  uint64_t budget() const { return budget_; }
  uint64_t live_bytes() const;
  // Whether `bytes` more would fit beside what is live now (always, without
  // a budget).
  bool has_room_for(uint64_t bytes) const;

 private:
  // Whether `need` more fits; throws OutOfMemoryError when it never can.
  bool fits(uint64_t bytes, uint64_t need) const;  // REQUIRES: mu_ held
  MemoryResource& upstream_;
  const uint64_t budget_, granularity_;
  mutable std::mutex mu_;
  uint64_t live_ = 0;  // GUARDED_BY(mu_)
};

// Asks `reclaim` when the upstream cannot serve an allocation, and tries
// again while it says it freed something. When it gives up it says why
// (`why_not`, appended to the error: "nothing more could be spilled").
// Called without any lock held: it may free memory of this very stack.
// Errors that are permanent (OutOfMemoryError::permanent) are not retried.
class ReclaimingAdaptor final : public MemoryResource {
 public:
  using Reclaim = std::function<bool(uint64_t bytes, std::string& why_not)>;
  ReclaimingAdaptor(MemoryResource& upstream, Reclaim reclaim);
  void* allocate(uint64_t bytes, StreamRef stream) override;
  void deallocate(void* p, uint64_t bytes, StreamRef stream) noexcept override {
    upstream_.deallocate(p, bytes, stream);
  }
  void* allocate_if_free(uint64_t bytes, StreamRef stream) override {
    return upstream_.allocate_if_free(bytes, stream);
  }

 private:
  MemoryResource& upstream_;
  Reclaim reclaim_;
};

// Counts what passes through: bytes in use (as asked), their peak, and the
// number of allocations.
class StatisticsAdaptor final : public MemoryResource {
 public:
  struct Counts {
    uint64_t in_use_bytes = 0, peak_in_use_bytes = 0, allocations = 0;
  };
  explicit StatisticsAdaptor(MemoryResource& upstream) : upstream_(upstream) {}
  void* allocate(uint64_t bytes, StreamRef stream) override;
  void deallocate(void* p, uint64_t bytes, StreamRef stream) noexcept override;
  void* allocate_if_free(uint64_t bytes, StreamRef stream) override;
  Counts counts() const;

 private:
  void count(uint64_t bytes);  // REQUIRES: mu_ held
  MemoryResource& upstream_;
  mutable std::mutex mu_;
  Counts counts_;  // GUARDED_BY(mu_)
};

}  // namespace leasehold
