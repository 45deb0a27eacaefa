// The chunk socket's questions: which chunks of which pool a session may
// map (shared/chunk_channel.h). Read-only on the core's state: handing out
// descriptors changes nothing the core keeps.
#include "coordinator/core.h"
#include "shared/printable.h"

namespace leasehold {

std::variant<ChunkGrant, std::string> CoordinatorCore::chunks_for(const ChunkRequest& req,
                                                                  int peer_pid) const {
  auto it = agents_.find(req.agent);
  if (it == agents_.end() || it->second.session != req.session) {
    return "agent '" + printable(req.agent, 128) +
           "' is not registered with this coordinator under that session";
  }
  const AgentRecord& agent = it->second;
  if (agent.process && agent.process->pid() != peer_pid) {
    return "the asking process (pid " + std::to_string(peer_pid) + ") is not agent '" + agent.name +
           "' (pid " + std::to_string(agent.process->pid()) + ")";
  }
  const DeviceState& dev = device_of(agent);
  const uint64_t chunk = dev.pool.alignment;
  if (req.kind == ChunkRequest::Kind::Lease) {
    const auto& leases = dev.leases.leases();
    auto l = leases.find(req.lease_id);
    if (l == leases.end() || l->second.owner != LeaseOwner::agent(agent.name)) {
      return "lease " + std::to_string(req.lease_id) + " is not agent '" + agent.name + "''s";
    }
    return ChunkGrant{dev.ordinal(), l->second.offset / chunk, l->second.size / chunk,
                      Access::ReadWrite};
  }
  const RegionRecord* r = dev.regions.find(req.region);
  if (r == nullptr || !r->resident() || !r->attached.count(agent.name)) {
    return "agent '" + agent.name + "' is not attached to region '" + printable(req.region, 128) +
           "'";
  }
  const bool fills = r->state == RegionState::Filling && r->filler == agent.name;
  return ChunkGrant{dev.ordinal(), r->offset / chunk, r->lease_bytes / chunk,
                    fills ? Access::ReadWrite : Access::ReadOnly};
}

}  // namespace leasehold
