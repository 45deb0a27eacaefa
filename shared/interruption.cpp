#include "shared/interruption.h"

namespace leasehold {

std::string_view interruption_name(Interruption i) {
  switch (i) {
    case Interruption::AgentDied: return "agent_died";
    case Interruption::AgentSilent: return "agent_silent";
    case Interruption::AgentLeft: return "agent_left";
    case Interruption::AgentStopped: return "agent_stopped";
    case Interruption::SessionLost: return "session_lost";
    case Interruption::CoordinatorRestart: return "coordinator_restart";
    case Interruption::DeviceFault: return "device_fault";
    case Interruption::Unacknowledged: return "unacknowledged";
    case Interruption::ReplicaLost: return "replica_lost";
  }
  return "unknown";
}

std::string_view interruption_words(Interruption i) {
  switch (i) {
    case Interruption::AgentDied: return "agent died";
    case Interruption::AgentSilent: return "agent fell silent";
    case Interruption::AgentLeft: return "agent left";
    case Interruption::AgentStopped: return "stopped by its agent";
    case Interruption::SessionLost: return "agent lost its session";
    case Interruption::CoordinatorRestart: return "coordinator restarted";
    case Interruption::DeviceFault: return "device fault";
    case Interruption::Unacknowledged: return "assignment not acknowledged";
    case Interruption::ReplicaLost: return "a replica lost the others";
  }
  return "unknown";
}

std::optional<Interruption> interruption_from_name(std::string_view name) {
  for (Interruption i : kInterruptions) {
    if (interruption_name(i) == name) return i;
  }
  return std::nullopt;
}

}  // namespace leasehold
