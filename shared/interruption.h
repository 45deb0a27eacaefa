// Why a running job went back to the queue. Each interruption is counted
// per job (`leasehold job`, `leasehold jobs`, the dashboard) and per cause
// in /metrics (leasehold_job_interruptions_total{cause}), so that an
// operator can tell a flaky agent from a restarted coordinator at a glance.
#pragma once

#include <array>
#include <optional>
#include <string_view>

namespace leasehold {

enum class Interruption {
  AgentDied,           // its agent's process exited (crashed, killed)
  AgentSilent,         // its agent fell silent while alive (stopped, hung), then was ended
  AgentLeft,           // its agent unregistered in order (stopped by its operator)
  AgentStopped,        // its agent stopped it (SIGTERM, a drain)
  SessionLost,         // its agent lost its session and came back without it
  CoordinatorRestart,  // the coordinator restarted and its agent did not come back with it
  DeviceFault,         // a GPU fault on its agent (its own, or shared under MPS)
  Unacknowledged,      // its agent never acknowledged the assignment
  ReplicaLost,         // a data-parallel replica lost the others (a collective or the rendezvous failed)
};

inline constexpr std::array<Interruption, 9> kInterruptions{
    Interruption::AgentDied,    Interruption::AgentSilent,        Interruption::AgentLeft,
    Interruption::AgentStopped, Interruption::SessionLost,        Interruption::CoordinatorRestart,
    Interruption::DeviceFault,  Interruption::Unacknowledged,     Interruption::ReplicaLost};

// The label value in /metrics and the key in job JSON ("agent_died").
std::string_view interruption_name(Interruption i);
// What `leasehold job` says ("agent died").
std::string_view interruption_words(Interruption i);
std::optional<Interruption> interruption_from_name(std::string_view name);

}  // namespace leasehold
