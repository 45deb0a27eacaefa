// The coordinator's options: built-in defaults, overridden by the TOML file,
// then by the environment (LEASEHOLD_ENDPOINT), then by flags.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "shared/endpoint.h"  // default_state_dir
#include "shared/units.h"

namespace leasehold {

struct CoordinatorOptions {
  // Where the ROUTER socket binds. Default: see shared/endpoint.h.
  std::string endpoint;
  // Where job events are published (PUB). Default: the endpoint's ipc path
  // with ".events" in place of ".sock" (required for other transports).
  std::string events_endpoint;
  // The read-only HTTP endpoint (coordinator/http_endpoint.h), HOST:PORT,
  // or "off". The default port is the one Prometheus' exporter list
  // assigns to OpenTelemetry-style exporters, on loopback only.
  std::string http_listen = "127.0.0.1:9464";
  // auto | cuda | host. auto picks cuda when a GPU is visible.
  std::string backend = "auto";
  // The CUDA devices served, a pool each: their ordinals (empty: every
  // visible device). Ignored on the host backend (see host_devices).
  std::vector<int> devices;
  // The host backend's devices: this many separate shared-memory segments,
  // ordinals 0..N-1, so that the multi-device paths run without a GPU.
  int host_devices = 1;
  // Pool size of each device: bytes, or a share of that device's free
  // memory at start (on the host backend, of the free host memory divided
  // among host_devices). One value for every device, or one per device in
  // the order of `devices`.
  std::vector<SizeSpec> pool_size{SizeSpec{0, 80.0}};
  // Every lease offset and size is a multiple of this. 2 MiB matches the
  // GPU's large-page granularity; smaller values waste less on small leases.
  uint64_t alignment = 2ull << 20;
  // Agents heart-beat at this interval. An agent whose process has exited
  // is dropped at the next check; one whose process the kernel shows
  // stopped (SIGSTOP, a debugger) has its leases fenced after two silent
  // intervals.
  std::chrono::milliseconds heartbeat_interval{1000};
  // Any other agent (its process runs but is slow, hung, or not local) has
  // its leases fenced only after this long without a message, counting
  // only time the coordinator itself ran: a busy host or a paused
  // coordinator interrupts no job (CoreOptions::silence_limit).
  std::chrono::milliseconds silence_limit{10000};
  // How long a lease request that does not fit may wait by default.
  std::chrono::milliseconds lease_wait_timeout{30000};
  // Where jobs are stored (jobs.db, SQLite) and checkpoints kept
  // (checkpoints/JOB_ID/). Default: see default_state_dir().
  std::string state_dir;
  // After a restart, how long a job that was running waits for its agent to
  // come back and say whether it still runs it; then it is requeued.
  std::chrono::milliseconds recovery_grace{10000};
  // An agent silent for recovery_grace after its leases were fenced, whose
  // process lives (stopped, hung), is SIGKILLed when this is set and it runs
  // as the coordinator's user, so that its memory can be reused; otherwise
  // the memory stays fenced until it exits (CoreOptions::end_silent_agents).
  bool end_silent_agents = true;
  // Finished jobs kept in the store: at most this many, none older than
  // the age. Their coordinator-made checkpoint folders go with them.
  uint32_t job_retention_count = 1000;
  // Limits (see CoreOptions): jobs queued per user, epochs and state
  // changes kept per job, lease requests waiting per agent.
  uint32_t queued_per_user = 1000, job_epochs_kept = 1000, job_history_kept = 100,
           waiting_per_agent = 64;
  // The longest wait a lease or region request may ask for.
  std::chrono::milliseconds max_lease_wait{std::chrono::hours(24)};
  // The longest job accepted.
  int64_t max_epochs = 100000, max_steps = 1000000000;
  // Malformed messages after which a connection is ignored.
  uint32_t malformed_limit = 100;
  std::chrono::milliseconds job_retention_age{std::chrono::hours(24 * 30)};
  // The scheduling policy: "occupancy" (guaranteed shares, watermarks,
  // shrinking; coordinator/occupancy.md) or "fifo" (first come, first
  // served: jobs over-committing the pool fail with out-of-memory).
  std::string policy = "occupancy";
  // Fractions of the pool: jobs grow past their guaranteed share only below
  // the low watermark; above the high one, agents are asked to shrink.
  double low_watermark = 0.80;
  double high_watermark = 0.95;
  // How long an agent asked to shrink has to answer (see CoreOptions).
  std::chrono::milliseconds shrink_timeout{10000};
  // Who may register as an agent, submit, and cancel others' jobs (group
  // names; empty: anyone who can reach the socket, cancelling others' jobs
  // aside). See coordinator/access.h.
  std::string agent_group, client_group, admin_group, program_group;
  // The ipc:// socket files' mode and group (connecting needs write
  // permission), and of a socket directory the coordinator creates (its
  // mode: the socket mode's read bits become search bits, 0660 -> 0750).
  // Empty group: the coordinator's own.
  uint32_t socket_mode = 0660;
  std::string socket_group;
  // CURVE for network (tcp://) endpoints, required there: the file of the
  // coordinator's key pair (`leasehold keygen`) and the directory of the
  // public keys allowed in (coordinator/zap_handler.h).
  std::string curve_key, curve_allowed_keys;
  // How long an agent has to acknowledge an assignment (see CoreOptions).
  std::chrono::milliseconds assign_timeout{10000};
  // How long an agent has to end a cancelled job (see CoreOptions).
  std::chrono::milliseconds stop_timeout{60000};
  // MPS (coordinator/mps_daemon.h): auto (on with the cuda backend when
  // nvidia-cuda-mps-control is on the PATH), on (a start-up error without
  // it) or off. mps_directory: the pipe folder of a daemon someone else
  // runs (a systemd unit); empty: the coordinator starts its own, with its
  // folders next to the ipc socket (else in the state directory).
  std::string mps = "auto";
  std::string mps_directory;
  // After an MPS fault shared by several jobs, how long each of them runs
  // alone (unless it reports an epoch first; see CoreOptions).
  std::chrono::milliseconds fault_probation{30000};
  std::string log_level = "info";
  // Test hook (hidden flag): on SIGUSR1 the poll loop sleeps this long, so
  // a test can see that systemd's watchdog pings stop when the loop does.
  std::chrono::milliseconds test_stall_on_sigusr1{0};
};

// Parses `text` as TOML and applies its keys. Throws std::invalid_argument
// naming `source` and the line or key for a syntax error, an unknown key, a
// wrong type or a bad value.
void apply_toml(CoordinatorOptions& opts, std::string_view text, const std::string& source);

// Parses flags (and the file named by --config). On --help prints usage and
// exits 0; on a bad flag or value prints the error and exits 2.
CoordinatorOptions parse_coordinator_options(int argc, char** argv);

// Checks ranges that individual parsers cannot (alignment power of two,
// intervals positive). Throws std::invalid_argument naming the option.
void validate(const CoordinatorOptions& opts);

}  // namespace leasehold
