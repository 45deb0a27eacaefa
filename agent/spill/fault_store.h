// A spill store that forwards to another and fails chosen calls, for tests
// of how jobs and the spill manager handle a full disk, a failing read or a
// corrupted chunk without touching a real disk.
//
// Thread safety: one thread calls it, as any SpillStore.
#pragma once

#include <string>
#include <unordered_map>
#include <unordered_set>

#include "agent/spill/spill_store.h"

namespace leasehold::spill {

class FaultInjectingSpillStore final : public SpillStore {
 public:
  // `inner` must outlive this store.
  explicit FaultInjectingSpillStore(SpillStore& inner) : inner_(inner) {}
  FaultInjectingSpillStore(const FaultInjectingSpillStore&) = delete;
  FaultInjectingSpillStore& operator=(const FaultInjectingSpillStore&) = delete;

  // The k-th put (1-based, counting every put since construction) fails
  // with ENOSPC and stores nothing. 0: no failing put.
  void fail_put_at(uint64_t k) { fail_put_at_ = k; }
  // Every put from the k-th on fails with ENOSPC (a disk that stays full).
  void fail_puts_from(uint64_t k) { fail_puts_from_ = k; }
  // Every get of `id` fails with EIO, until clear_faults().
  void fail_get_of(SpillId id) { fail_gets_.insert(id); }
  // Every get of `id` reports a checksum mismatch naming the tensor, until
  // clear_faults(). The inner store keeps the bytes intact.
  void corrupt_get_of(SpillId id) { corrupt_gets_.insert(id); }
  void clear_faults();

  // Calls made so far, failed ones included.
  uint64_t puts() const { return puts_; }
  uint64_t gets() const { return gets_; }

  Status put(SpillId id, const void* src, size_t bytes, const std::string& name) override;
  bool copied(SpillId id) override { return inner_.copied(id); }
  Status wait_copied(SpillId id) override { return inner_.wait_copied(id); }
  void prefetch(SpillId id) override { inner_.prefetch(id); }
  Status get(SpillId id, void* dst) override;
  void erase(SpillId id) override;
  SpillStats stats() const override { return inner_.stats(); }
  std::shared_ptr<engine::Allocator> host_allocator() override { return inner_.host_allocator(); }

 private:
  std::string name_of(SpillId id) const;

  SpillStore& inner_;
  uint64_t fail_put_at_ = 0;
  uint64_t fail_puts_from_ = 0;
  std::unordered_set<SpillId> fail_gets_;
  std::unordered_set<SpillId> corrupt_gets_;
  std::unordered_map<SpillId, std::string> names_;  // of the tensors stored, for messages
  uint64_t puts_ = 0;
  uint64_t gets_ = 0;
};

}  // namespace leasehold::spill
