// Memory that a program job's session had (its process runs somebody
// else's code) goes to nobody else before its chunks have new memory: the
// process may have kept the old memory mapped (cuMemRetainAllocationHandle
// and a map of its own, a copied host mapping, a descriptor passed on), and
// would reach the next holder's tensors through it. Such leases, released
// or reclaimed, pass to LeaseOwner::renewing until the broker's chunk
// renewer (coordinator/chunk_renewer.h) has given their chunks new memory
// (DevicePool::renew); then they are free. The agent's own sessions run
// Leasehold's code and give memory back directly.
#include "coordinator/core.h"

#include <spdlog/spdlog.h>

#include "shared/units.h"

namespace leasehold {

std::variant<std::pair<size_t, uint64_t>, Refusal> CoordinatorCore::give_back(
    DeviceState& dev, const LeaseOwner& owner, bool renew, const std::string& who,
    std::optional<uint64_t> lease_id) {
  if (!renew) {
    if (!lease_id) return dev.leases.release_all(owner);
    const uint64_t bytes = dev.leases.leases().count(*lease_id)
                               ? dev.leases.leases().at(*lease_id).size
                               : 0;
    if (auto refusal = dev.leases.release(owner, *lease_id)) return *refusal;
    return std::pair<size_t, uint64_t>{1, bytes};
  }
  const LeaseOwner to = LeaseOwner::renewing(who);
  std::vector<uint64_t> ids;
  if (lease_id) {
    if (auto refusal = dev.leases.hand_over(owner, *lease_id, to)) return *refusal;
    ids.push_back(*lease_id);
  } else {
    for (const auto& [id, rec] : dev.leases.leases()) {
      if (rec.owner == owner) ids.push_back(id);
    }
    dev.leases.transfer_all(owner, to);  // also drops its waiting requests
  }
  uint64_t bytes = 0;
  for (uint64_t id : ids) {
    bytes += dev.leases.leases().at(id).size;
    renew_later(dev, id);
  }
  return std::pair<size_t, uint64_t>{ids.size(), bytes};
}

void CoordinatorCore::renew_later(const DeviceState& dev, uint64_t lease_id) {
  const LeaseRecord& rec = dev.leases.leases().at(lease_id);
  renewals_.push_back({dev.ordinal(), lease_id, rec.offset / dev.pool.alignment,
                       rec.size / dev.pool.alignment});
}

void CoordinatorCore::chunks_renewed(int device, uint64_t lease_id, const std::string& error,
                                     Effects& out) {
  auto d = devices_.find(device);
  if (d == devices_.end()) return;
  DeviceState& dev = d->second;
  auto it = dev.leases.leases().find(lease_id);
  if (it == dev.leases.leases().end() || it->second.owner.kind != LeaseOwner::Kind::Renewing) {
    return;
  }
  const LeaseRecord rec = it->second;
  if (!error.empty()) {
    spdlog::error(
        "{}: {} at offset {} that '{}' had cannot get new memory, and stays out of service: {}",
        dev.label(), format_bytes(rec.size), rec.offset, rec.owner.name, error);
    return;
  }
  dev.leases.release(rec.owner, lease_id);
  spdlog::debug("{}: {} that '{}' had has new memory", dev.label(), format_bytes(rec.size),
                rec.owner.name);
  serve_waiting(dev, out);
}

}  // namespace leasehold
