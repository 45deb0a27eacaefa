// A spill store in plain heap memory: every tensor gets its own allocation
// and put() waits for the copy, so copied() is always true. For tests and
// for budgets where only correctness matters; on the CUDA backend the copies
// go to pageable memory, which is slower and synchronous.
//
// Thread safety: one thread calls it (it runs no threads of its own).
#pragma once

#include <memory>
#include <string>
#include <unordered_map>

#include "agent/spill/spill_store.h"
#include "agent/spill/transfer.h"

namespace leasehold::spill {

class MemorySpillStore final : public SpillStore {
 public:
  // `transfer` must outlive the store. `limit_bytes`: the most tensor bytes
  // held at once (0: no limit); a put beyond it fails with ENOSPC.
  explicit MemorySpillStore(Transfer& transfer, uint64_t limit_bytes = 0);

  Status put(SpillId id, const void* src, size_t bytes, const std::string& name) override;
  bool copied(SpillId id) override;
  Status wait_copied(SpillId id) override;
  void prefetch(SpillId id) override;
  Status get(SpillId id, void* dst) override;
  void erase(SpillId id) override;
  SpillStats stats() const override;

 private:
  struct Entry {
    std::unique_ptr<char[]> data;
    size_t bytes = 0;
    std::string name;
  };

  Transfer& transfer_;
  uint64_t limit_;
  std::unordered_map<SpillId, Entry> entries_;
  SpillStats stats_;  // all but copy_busy_seconds
};

}  // namespace leasehold::spill
