// The status view: pool usage, agents and leases, for `leasehold status`.
#include "coordinator/coordinator.h"
#include "coordinator/replies.h"

namespace leasehold {

void Coordinator::on_status(const std::string& rid, const proto::Envelope& env) {
  const auto now = Clock::now();
  const auto& alloc = leases_->allocator();
  flatbuffers::FlatBufferBuilder fbb(1024);

  auto info = build_pool_info(fbb, pool());
  auto usage = proto::CreatePoolUsage(fbb, info, alloc.used_bytes(), alloc.free_bytes(),
                                      alloc.largest_free(),
                                      static_cast<uint32_t>(alloc.free_block_count()));

  // Per-agent totals in one pass over the leases.
  std::map<std::string, std::pair<uint64_t, uint32_t>> held;
  for (const auto& [id, rec] : leases_->leases()) {
    auto& h = held[rec.owner];
    h.first += rec.size;
    h.second += 1;
  }
  std::vector<flatbuffers::Offset<proto::AgentInfo>> agents;
  for (const auto& [name, agent] : agents_) {
    auto [bytes, count] = held[name];
    // last_seen is in the future while an agent is within its first-heartbeat grace.
    auto ago = std::max(std::chrono::milliseconds(0),
                        std::chrono::duration_cast<std::chrono::milliseconds>(now - agent.last_seen));
    agents.push_back(proto::CreateAgentInfo(fbb, fbb.CreateString(name), agent.pid, agent.device,
                                            fbb.CreateString(agent.job_id ? "running" : count ? "leasing" : "idle"), bytes,
                                            count, static_cast<uint64_t>(ago.count())));
  }
  std::vector<flatbuffers::Offset<proto::Lease>> leases;
  for (const auto& [id, rec] : leases_->leases()) leases.push_back(build_lease(fbb, rec));

  auto uptime = std::chrono::duration_cast<std::chrono::milliseconds>(now - started_);
  auto body = proto::CreateStatusReply(fbb, usage, fbb.CreateVector(agents),
                                       fbb.CreateVector(leases),
                                       static_cast<uint32_t>(leases_->waiting()),
                                       static_cast<uint64_t>(uptime.count()));
  finish_envelope(fbb, {env.header()->request_id(), "coordinator", 0}, proto::Body::StatusReply,
                  body.Union());
  reply(rid, to_message(fbb));
}

}  // namespace leasehold
