#include "coordinator/options.h"

#include <CLI/CLI.hpp>
#include <toml++/toml.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <iostream>
#include <optional>
#include <stdexcept>

#include "coordinator/http_endpoint.h"
#include "shared/curve_keys.h"
#include "shared/endpoint.h"

namespace leasehold {
namespace {

std::string as_string(const toml::node& node, const std::string& key, const std::string& source) {
  if (auto s = node.value<std::string>()) return *s;
  if (node.is_integer()) return std::to_string(*node.value<int64_t>());
  if (auto d = node.value<double>()) {
    std::ostringstream out;
    out << *d;
    return out.str();
  }
  throw std::invalid_argument(source + ": key '" + key + "' must be a string or a number");
}

template <class F>
void with_key(const std::string& key, const std::string& source, F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    throw std::invalid_argument(source + ": key '" + key + "': " + e.what());
  }
}

uint32_t parse_mode(const std::string& text) {
  size_t used = 0;
  unsigned long v = std::stoul(text, &used, 8);
  if (used != text.size() || v > 0777 || (v & 0600) != 0600) {
    throw std::invalid_argument("'" + text +
                                "' is not an octal file mode of at most 0777 that lets the owner "
                                "read and write (e.g. 0660)");
  }
  return static_cast<uint32_t>(v);
}

uint32_t parse_count(const std::string& text) {
  size_t used = 0;
  long long v = std::stoll(text, &used);
  if (used != text.size() || v < 1 || v > 100000000) {
    throw std::invalid_argument("'" + text + "' is not a count between 1 and 100000000");
  }
  return static_cast<uint32_t>(v);
}

}  // namespace

void apply_toml(CoordinatorOptions& opts, std::string_view text, const std::string& source) {
  toml::table doc;
  try {
    doc = toml::parse(text, source);
  } catch (const toml::parse_error& e) {
    throw std::invalid_argument(source + ": " + std::string(e.description()) + " at line " +
                                std::to_string(e.source().begin.line));
  }
  for (const auto& [k, node] : doc) {
    std::string key(k.str());
    std::string value = as_string(node, key, source);
    with_key(key, source, [&] {
      if (key == "endpoint") {
        opts.endpoint = value;
      } else if (key == "events_endpoint") {
        opts.events_endpoint = value;
      } else if (key == "http_listen") {
        opts.http_listen = value;
      } else if (key == "backend") {
        opts.backend = value;
      } else if (key == "device") {
        opts.device = std::stoi(value);
      } else if (key == "pool_size") {
        opts.pool_size = parse_size_spec(value);
      } else if (key == "alignment") {
        opts.alignment = parse_bytes(value);
      } else if (key == "heartbeat_interval") {
        opts.heartbeat_interval = parse_duration(value);
      } else if (key == "lease_wait_timeout") {
        opts.lease_wait_timeout = parse_duration(value);
      } else if (key == "state_dir") {
        opts.state_dir = value;
      } else if (key == "recovery_grace") {
        opts.recovery_grace = parse_duration(value);
      } else if (key == "job_retention_count") {
        opts.job_retention_count = parse_count(value);
      } else if (key == "queued_per_user") {
        opts.queued_per_user = parse_count(value);
      } else if (key == "job_epochs_kept") {
        opts.job_epochs_kept = parse_count(value);
      } else if (key == "job_history_kept") {
        opts.job_history_kept = parse_count(value);
      } else if (key == "waiting_per_agent") {
        opts.waiting_per_agent = parse_count(value);
      } else if (key == "malformed_limit") {
        opts.malformed_limit = parse_count(value);
      } else if (key == "job_retention_age") {
        opts.job_retention_age = parse_duration(value);
      } else if (key == "log_level") {
        opts.log_level = value;
      } else if (key == "policy") {
        opts.policy = value;
      } else if (key == "low_watermark") {
        opts.low_watermark = parse_fraction(value);
      } else if (key == "high_watermark") {
        opts.high_watermark = parse_fraction(value);
      } else if (key == "shrink_timeout") {
        opts.shrink_timeout = parse_duration(value);
      } else if (key == "agent_group") {
        opts.agent_group = value;
      } else if (key == "client_group") {
        opts.client_group = value;
      } else if (key == "admin_group") {
        opts.admin_group = value;
      } else if (key == "socket_mode") {
        // A string ("0660"), or TOML's own octal integer (0o660).
        char octal[16];
        std::snprintf(octal, sizeof octal, "%llo",
                      static_cast<unsigned long long>(node.value<int64_t>().value_or(0)));
        opts.socket_mode = parse_mode(node.is_integer() ? std::string(octal) : value);
      } else if (key == "socket_group") {
        opts.socket_group = value;
      } else if (key == "curve_key") {
        opts.curve_key = value;
      } else if (key == "curve_allowed_keys") {
        opts.curve_allowed_keys = value;
      } else if (key == "assign_timeout") {
        opts.assign_timeout = parse_duration(value);
      } else if (key == "mps") {
        opts.mps = value;
      } else if (key == "mps_directory") {
        opts.mps_directory = value;
      } else if (key == "fault_probation") {
        opts.fault_probation = parse_duration(value);
      } else {
        throw std::invalid_argument(
            "unknown key (known: endpoint, events_endpoint, http_listen, backend, device, "
            "pool_size, alignment, "
            "heartbeat_interval, lease_wait_timeout, state_dir, recovery_grace, "
            "job_retention_count, job_retention_age, queued_per_user, job_epochs_kept, "
            "job_history_kept, waiting_per_agent, malformed_limit, policy, low_watermark, high_watermark, "
            "shrink_timeout, assign_timeout, agent_group, client_group, admin_group, "
            "socket_mode, socket_group, curve_key, curve_allowed_keys, mps, "
            "mps_directory, fault_probation, log_level)");
      }
    });
  }
}


void validate(const CoordinatorOptions& opts) {
  if (opts.endpoint.empty()) throw std::invalid_argument("endpoint is empty");
  if (opts.events_endpoint.empty()) {
    throw std::invalid_argument("events_endpoint must be set for endpoint " + opts.endpoint);
  }
  if (opts.backend != "auto" && opts.backend != "cuda" && opts.backend != "host") {
    throw std::invalid_argument("backend '" + opts.backend + "' is not one of auto, cuda, host");
  }
  if (opts.device < 0) throw std::invalid_argument("device must be >= 0");
  if (opts.http_listen != "off") parse_http_listen(opts.http_listen);
  if (!is_power_of_two(opts.alignment) || opts.alignment < 256) {
    throw std::invalid_argument("alignment " + std::to_string(opts.alignment) +
                                " must be a power of two of at least 256 bytes");
  }
  if (opts.pool_size.percent == 0 && opts.pool_size.bytes < opts.alignment) {
    throw std::invalid_argument("pool_size " + opts.pool_size.to_string() +
                                " is smaller than the alignment");
  }
  if (opts.heartbeat_interval.count() < 10) {
    throw std::invalid_argument("heartbeat_interval must be at least 10ms");
  }
  if (opts.lease_wait_timeout.count() < 0) {
    throw std::invalid_argument("lease_wait_timeout must not be negative");
  }
  if (opts.state_dir.empty()) throw std::invalid_argument("state_dir is empty");
  if (opts.recovery_grace.count() < 0) {
    throw std::invalid_argument("recovery_grace must not be negative");
  }
  for (auto [name, value] : {std::pair{"queued_per_user", opts.queued_per_user},
                              {"job_epochs_kept", opts.job_epochs_kept},
                              {"job_history_kept", opts.job_history_kept},
                              {"waiting_per_agent", opts.waiting_per_agent},
                              {"malformed_limit", opts.malformed_limit}}) {
    if (value < 1) throw std::invalid_argument(std::string(name) + " must be at least 1");
  }
  if (opts.job_retention_count < 1) {
    throw std::invalid_argument("job_retention_count must be at least 1");
  }
  if (opts.policy != "occupancy" && opts.policy != "fifo") {
    throw std::invalid_argument("policy '" + opts.policy + "' is not one of occupancy, fifo");
  }
  if (!(opts.low_watermark > 0 && opts.low_watermark <= opts.high_watermark &&
        opts.high_watermark <= 1)) {
    throw std::invalid_argument("low_watermark " + std::to_string(opts.low_watermark) +
                                " and high_watermark " + std::to_string(opts.high_watermark) +
                                " must satisfy 0 < low <= high <= 1");
  }
  if (opts.mps != "auto" && opts.mps != "on" && opts.mps != "off") {
    throw std::invalid_argument("mps '" + opts.mps + "' is not one of auto, on, off");
  }
  if (opts.mps == "on" && opts.backend == "host") {
    throw std::invalid_argument("mps = on needs the cuda backend (backend is host)");
  }
  if (opts.mps == "off" && !opts.mps_directory.empty()) {
    throw std::invalid_argument("mps_directory " + opts.mps_directory +
                                " is set but mps is off (set mps to auto or on)");
  }
  if (opts.fault_probation.count() < 0) {
    throw std::invalid_argument("fault_probation must not be negative");
  }
  if (opts.shrink_timeout.count() < 10) {
    throw std::invalid_argument("shrink_timeout must be at least 10ms");
  }
  if (opts.assign_timeout.count() <= 0) throw std::invalid_argument("assign_timeout must be positive");
  for (const std::string& e : {opts.endpoint, opts.events_endpoint}) {
    if (needs_curve(e) && (opts.curve_key.empty() || opts.curve_allowed_keys.empty())) {
      throw std::invalid_argument(
          e + " is a network endpoint, which Leasehold serves only with CURVE: set curve_key "
          "(a key pair file from `leasehold keygen`) and curve_allowed_keys (a directory of the "
          "clients' and agents' .pub files)");
    }
  }
}

CoordinatorOptions parse_coordinator_options(int argc, char** argv) {
  CLI::App app{"leasehold-coordinator: owns a GPU (or host) memory pool and leases it to agents"};
  std::optional<std::string> config, endpoint, backend, pool_size, alignment, heartbeat, wait,
      log_level, state_dir, recovery_grace, retention_age, policy, low_watermark, high_watermark,
      shrink_timeout, assign_timeout, mps, mps_directory, fault_probation, test_stall, http,
      agent_group, client_group, admin_group, socket_mode, socket_group, curve_key,
      curve_allowed_keys;
  std::optional<uint32_t> retention_count, queued_per_user, epochs_kept, history_kept,
      waiting_per_agent, malformed_limit;
  std::optional<int> device;
  app.add_option("--config", config, "TOML configuration file")->check(CLI::ExistingFile);
  app.add_option("--endpoint", endpoint,
                 "ZeroMQ endpoint to bind (default: $LEASEHOLD_ENDPOINT or an ipc:// socket in "
                 "the runtime directory)");
  std::optional<std::string> events;
  app.add_option("--events-endpoint", events,
                 "PUB endpoint for job events (default: next to the ipc endpoint)");
  app.add_option("--backend", backend, "auto|cuda|host (default auto)");
  app.add_option("--device", device, "CUDA device ordinal (default 0)");
  app.add_option("--pool-size", pool_size,
                 "pool size: bytes with a unit (4GiB) or a share of free memory (90%)");
  app.add_option("--alignment", alignment, "lease alignment (default 2MiB)");
  app.add_option("--heartbeat-interval", heartbeat, "agent heartbeat interval (default 1s)");
  app.add_option("--lease-wait-timeout", wait,
                 "default time a lease request may wait for memory (default 30s)");
  app.add_option("--state-dir", state_dir,
                 "where jobs and checkpoints are stored (default: $STATE_DIRECTORY, "
                 "$XDG_STATE_HOME/leasehold, ~/.local/state/leasehold or /var/lib/leasehold)");
  app.add_option("--recovery-grace", recovery_grace,
                 "after a restart, how long a running job waits for its agent (default 10s)");
  app.add_option("--job-retention-count", retention_count,
                 "finished jobs kept in the store (default 1000)")
      ->check(CLI::Range(1u, 100000000u));
  app.add_option("--job-retention-age", retention_age,
                 "finished jobs older than this are pruned (default 30d)");
  app.add_option("--policy", policy,
                 "scheduling policy: occupancy (default) or fifo (first come, first served)");
  app.add_option("--low-watermark", low_watermark,
                 "jobs grow past their guaranteed share only below this occupancy (default 80%)");
  app.add_option("--high-watermark", high_watermark,
                 "above this occupancy agents are asked to shrink (default 95%)");
  app.add_option("--shrink-timeout", shrink_timeout,
                 "how long an agent asked to shrink has to answer (default 10s)");
  app.add_option("--queued-per-user", queued_per_user,
                 "jobs one user may have queued (default 1000)");
  app.add_option("--job-epochs-kept", epochs_kept,
                 "epoch results kept per job, the latest (default 1000)");
  app.add_option("--job-history-kept", history_kept,
                 "state changes kept per job, the latest (default 100)");
  app.add_option("--waiting-per-agent", waiting_per_agent,
                 "lease requests one agent may have waiting for memory (default 64)");
  app.add_option("--malformed-limit", malformed_limit,
                 "malformed messages after which a connection is ignored (default 100)");
  app.add_option("--assign-timeout", assign_timeout,
                 "an assignment an agent does not acknowledge by then goes back to the queue "
                 "and the agent gets no more jobs in its session (default 10s)");
  app.add_option("--agent-group", agent_group,
                 "only members of this group (and root) may register as agents (default: anyone "
                 "who can reach the socket)");
  app.add_option("--client-group", client_group,
                 "only members of this group (and root) may submit jobs and drop regions");
  app.add_option("--admin-group", admin_group,
                 "members may cancel anyone's job (a submitter may always cancel their own)");
  app.add_option("--socket-mode", socket_mode,
                 "octal mode of the ipc:// socket files: who may connect (default 0660)");
  app.add_option("--socket-group", socket_group,
                 "group of the ipc:// socket files and of a socket folder the coordinator "
                 "creates (default: the coordinator's)");
  app.add_option("--curve-key", curve_key,
                 "the coordinator's CURVE key pair file (`leasehold keygen`): required for "
                 "tcp:// endpoints");
  app.add_option("--curve-allowed-keys", curve_allowed_keys,
                 "directory of the .pub files of clients and agents allowed over tcp://");
  app.add_option("--mps", mps,
                 "auto|on|off: run the GPU work under an MPS daemon the coordinator starts "
                 "(default auto: when the cuda backend is used and nvidia-cuda-mps-control is "
                 "on the PATH)");
  app.add_option("--mps-directory", mps_directory,
                 "pipe folder of an MPS daemon someone else runs (instead of starting one)");
  app.add_option("--fault-probation", fault_probation,
                 "under MPS, after a device fault shared by several jobs: how long each runs "
                 "alone before others run beside it, unless it finishes an epoch first "
                 "(default 30s)");
  app.add_option("--http", http,
                 "HOST:PORT of the read-only HTTP endpoint (dashboard page, /metrics, /api/...), or off "
                 "(default 127.0.0.1:9464)");
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error (default info)");
  app.add_option("--test-stall-on-sigusr1", test_stall, "test hook: stall the loop on SIGUSR1")
      ->group("");  // hidden: not for operators
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    std::exit(app.exit(e));
  }

  CoordinatorOptions opts;
  try {
    opts.endpoint = default_endpoint();  // includes $LEASEHOLD_ENDPOINT
    opts.state_dir = default_state_dir();
    if (config) {
      std::ifstream in(*config);
      std::stringstream text;
      text << in.rdbuf();
      if (!in) throw std::invalid_argument("cannot read configuration file " + *config);
      apply_toml(opts, text.str(), *config);
      // The environment overrides the file's endpoint.
      if (const char* env = std::getenv(kEndpointEnv); env && *env) opts.endpoint = env;
    }
    if (endpoint) opts.endpoint = *endpoint;
    if (events) opts.events_endpoint = *events;
    if (opts.events_endpoint.empty()) opts.events_endpoint = default_events_endpoint(opts.endpoint);
    if (backend) opts.backend = *backend;
    if (device) opts.device = *device;
    if (pool_size) opts.pool_size = parse_size_spec(*pool_size);
    if (alignment) opts.alignment = parse_bytes(*alignment);
    if (heartbeat) opts.heartbeat_interval = parse_duration(*heartbeat);
    if (wait) opts.lease_wait_timeout = parse_duration(*wait);
    if (log_level) opts.log_level = *log_level;
    if (state_dir) opts.state_dir = *state_dir;
    if (recovery_grace) opts.recovery_grace = parse_duration(*recovery_grace);
    if (retention_count) opts.job_retention_count = *retention_count;
    if (queued_per_user) opts.queued_per_user = *queued_per_user;
    if (epochs_kept) opts.job_epochs_kept = *epochs_kept;
    if (history_kept) opts.job_history_kept = *history_kept;
    if (waiting_per_agent) opts.waiting_per_agent = *waiting_per_agent;
    if (malformed_limit) opts.malformed_limit = *malformed_limit;
    if (retention_age) opts.job_retention_age = parse_duration(*retention_age);
    if (policy) opts.policy = *policy;
    if (low_watermark) opts.low_watermark = parse_fraction(*low_watermark);
    if (high_watermark) opts.high_watermark = parse_fraction(*high_watermark);
    if (shrink_timeout) opts.shrink_timeout = parse_duration(*shrink_timeout);
    if (assign_timeout) opts.assign_timeout = parse_duration(*assign_timeout);
    if (agent_group) opts.agent_group = *agent_group;
    if (client_group) opts.client_group = *client_group;
    if (admin_group) opts.admin_group = *admin_group;
    if (socket_mode) opts.socket_mode = parse_mode(*socket_mode);
    if (socket_group) opts.socket_group = *socket_group;
    if (curve_key) opts.curve_key = *curve_key;
    if (curve_allowed_keys) opts.curve_allowed_keys = *curve_allowed_keys;
    if (mps) opts.mps = *mps;
    if (mps_directory) opts.mps_directory = *mps_directory;
    if (fault_probation) opts.fault_probation = parse_duration(*fault_probation);
    if (test_stall) opts.test_stall_on_sigusr1 = parse_duration(*test_stall);
    if (http) opts.http_listen = *http;
    validate(opts);
  } catch (const std::exception& e) {
    std::cerr << "leasehold-coordinator: " << e.what() << "\n";
    std::exit(2);
  }
  return opts;
}

}  // namespace leasehold
