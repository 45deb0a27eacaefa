#include "agent/spill/memory_store.h"

#include <algorithm>
#include <cerrno>
#include <new>

#include "shared/units.h"

namespace leasehold::spill {

MemorySpillStore::MemorySpillStore(Transfer& transfer, uint64_t limit_bytes)
    : transfer_(transfer), limit_(limit_bytes) {}

Status MemorySpillStore::put(SpillId id, const void* src, size_t bytes, const std::string& name) {
  if (entries_.count(id)) {
    return Status::invalid_argument("spill id " + std::to_string(id) + " (tensor " + name +
                                    ") is already stored");
  }
  if (limit_ && stats_.host_bytes + bytes > limit_) {
    return Status::io_error("no room to spill tensor " + name + " (" + std::to_string(bytes) +
                                " bytes): memory spill store holds " +
                                format_bytes(stats_.host_bytes) + " of its limit of " +
                                format_bytes(limit_),
                            ENOSPC);
  }
  Entry e;
  e.bytes = bytes;
  e.name = name;
  try {
    if (bytes > 0) {
      e.data.reset(new char[bytes]);
      transfer_.to_host(e.data.get(), src, bytes);
      // Waiting here keeps the store simple: the source is free on return.
      transfer_.mark()->wait();
    }
  } catch (const std::bad_alloc&) {
    return Status::io_error("cannot allocate " + format_bytes(bytes) + " to spill tensor " + name,
                            ENOMEM);
  } catch (const std::exception& ex) {
    return Status::io_error("cannot copy tensor " + name + " off the device: " + ex.what(), EIO);
  }
  entries_.emplace(id, std::move(e));
  stats_.host_bytes += bytes;
  stats_.peak_host_bytes = std::max(stats_.peak_host_bytes, stats_.host_bytes);
  stats_.bytes_out += bytes;
  return Status::OK();
}

bool MemorySpillStore::copied(SpillId) { return true; }

Status MemorySpillStore::wait_copied(SpillId id) {
  if (!entries_.count(id)) {
    return Status::not_found("spill id " + std::to_string(id) + " is not stored");
  }
  return Status::OK();
}

void MemorySpillStore::prefetch(SpillId) {}

Status MemorySpillStore::get(SpillId id, void* dst) {
  auto it = entries_.find(id);
  if (it == entries_.end()) {
    return Status::not_found("spill id " + std::to_string(id) + " is not stored");
  }
  const Entry& e = it->second;
  if (e.bytes == 0) return Status::OK();
  try {
    transfer_.to_device(dst, e.data.get(), e.bytes);
    transfer_.compute_waits(transfer_.mark());
  } catch (const std::exception& ex) {
    return Status::io_error("cannot copy tensor " + e.name + " to the device: " + ex.what(), EIO);
  }
  stats_.bytes_in += e.bytes;
  return Status::OK();
}

void MemorySpillStore::erase(SpillId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  // No wait for a get's copy: a copy from pageable memory has consumed its
  // source when cudaMemcpyAsync returns (CUDA's API synchronization rules).
  stats_.host_bytes -= it->second.bytes;
  entries_.erase(it);
}

SpillStats MemorySpillStore::stats() const {
  SpillStats s = stats_;
  try {
    s.copy_busy_seconds = transfer_.busy_seconds();
  } catch (const std::exception&) {
    // A device fault; the next get or put reports it.
  }
  return s;
}

}  // namespace leasehold::spill
