#include "agent/spill/fault_store.h"

#include <cerrno>

namespace leasehold::spill {

void FaultInjectingSpillStore::clear_faults() {
  fail_put_at_ = 0;
  fail_puts_from_ = 0;
  fail_gets_.clear();
  corrupt_gets_.clear();
}

std::string FaultInjectingSpillStore::name_of(SpillId id) const {
  auto it = names_.find(id);
  return it != names_.end() ? it->second : "with spill id " + std::to_string(id);
}

Status FaultInjectingSpillStore::put(SpillId id, const void* src, size_t bytes,
                                     const std::string& name) {
  ++puts_;
  if (puts_ == fail_put_at_ || (fail_puts_from_ && puts_ >= fail_puts_from_)) {
    return Status::io_error(
        "no room to spill tensor " + name + " (" + std::to_string(bytes) + " bytes) (injected)",
        ENOSPC);
  }
  Status st = inner_.put(id, src, bytes, name);
  if (st.ok()) names_[id] = name;
  return st;
}

Status FaultInjectingSpillStore::get(SpillId id, void* dst) {
  ++gets_;
  if (fail_gets_.count(id)) {
    return Status::io_error("cannot read spilled tensor " + name_of(id) + " (injected)", EIO);
  }
  if (corrupt_gets_.count(id)) {
    return Status::corruption("checksum mismatch in spilled tensor " + name_of(id) + " (injected)");
  }
  return inner_.get(id, dst);
}

void FaultInjectingSpillStore::erase(SpillId id) {
  names_.erase(id);
  inner_.erase(id);
}

}  // namespace leasehold::spill
