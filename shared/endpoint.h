// Where the coordinator listens and where state lives, as every program
// finds them.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace leasehold {

// Environment variable that overrides the built-in default endpoint for the
// coordinator, the agents and the client.
inline constexpr const char* kEndpointEnv = "LEASEHOLD_ENDPOINT";

// The endpoint to use when no flag or config names one: $LEASEHOLD_ENDPOINT,
// else ipc://$XDG_RUNTIME_DIR/leasehold/coordinator.sock, else
// ipc:///run/leasehold/coordinator.sock (the systemd unit's RuntimeDirectory).
std::string default_endpoint();

// For "ipc://PATH" returns PATH; nullopt for other transports.
std::optional<std::string> ipc_path(std::string_view endpoint);

// The events (PUB) endpoint that goes with `endpoint` when none is
// configured: "ipc://DIR/NAME.sock" -> "ipc://DIR/NAME.events"; empty for
// other transports, which must name one.
std::string default_events_endpoint(const std::string& endpoint);

// Where Leasehold keeps state when not told: $STATE_DIRECTORY (the systemd
// unit's StateDirectory), else $XDG_STATE_HOME/leasehold, else
// ~/.local/state/leasehold, else /var/lib/leasehold.
std::string default_state_dir();

// An agent's state folder (its spill files) when not told: the systemd
// unit's $STATE_DIRECTORY (one instance per unit), else a folder of the
// coordinator it serves under default_state_dir():
// "…/agents/ipc_run_user_1000_leasehold_coordinator.sock". Agents of two
// coordinators on one machine never share one.
std::string default_agent_state_dir(const std::string& endpoint);

}  // namespace leasehold
