#include "coordinator/options.h"

#include <toml++/toml.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <vector>

#include "coordinator/http_endpoint.h"
#include "shared/curve_keys.h"
#include "shared/endpoint.h"

namespace leasehold {
namespace {

// `text` as a whole decimal number, all of it; nullopt otherwise.
std::optional<long long> whole_number(const std::string& text) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    return std::nullopt;
  }
  if (used != text.size()) return std::nullopt;
  return v;
}

// A whole number in [1, max].
int64_t parse_count(const std::string& text, int64_t max = 100000000) {
  auto v = whole_number(text);
  if (!v || *v < 1 || *v > max) {
    throw std::invalid_argument("'" + text + "' is not a count between 1 and " +
                                std::to_string(max));
  }
  return *v;
}

uint32_t parse_mode(const std::string& text) {
  size_t used = 0;
  unsigned long v = 0;
  try {
    v = std::stoul(text, &used, 8);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used == 0 || used != text.size() || v > 0777 || (v & 0600) != 0600) {
    throw std::invalid_argument("'" + text +
                                "' is not an octal file mode of at most 0777 that lets the owner "
                                "read and write (e.g. 0660)");
  }
  return static_cast<uint32_t>(v);
}

// Devices a coordinator may serve (more than any server has).
constexpr int64_t kMaxDevices = 64;

int parse_ordinal(const std::string& text) {
  auto v = whole_number(text);
  if (!v || *v < 0 || *v >= kMaxDevices) {
    throw std::invalid_argument("'" + text + "' is not a device ordinal (0 to " +
                                std::to_string(kMaxDevices - 1) + ")");
  }
  return static_cast<int>(*v);
}

// The comma-separated items of `text`, trimmed; an empty one is an error.
std::vector<std::string> items(const std::string& text) {
  std::vector<std::string> out;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) {
    const auto b = item.find_first_not_of(" \t"), e = item.find_last_not_of(" \t");
    if (b == std::string::npos) throw std::invalid_argument("'" + text + "' has an empty item");
    out.push_back(item.substr(b, e - b + 1));
  }
  if (out.empty() || text.back() == ',') {
    throw std::invalid_argument("'" + text + "' has an empty item");
  }
  return out;
}

std::vector<int> parse_devices(const std::string& text) {
  if (text == "all") return {};
  std::vector<int> out;
  for (const auto& item : items(text)) {
    int ordinal = parse_ordinal(item);
    if (std::find(out.begin(), out.end(), ordinal) != out.end()) {
      throw std::invalid_argument("device " + item + " is listed twice");
    }
    out.push_back(ordinal);
  }
  return out;
}

std::vector<SizeSpec> parse_pool_sizes(const std::string& text) {
  std::vector<SizeSpec> out;
  for (const auto& item : items(text)) out.push_back(parse_size_spec(item));
  return out;
}

bool parse_bool(const std::string& text) {
  if (text == "true" || text == "on" || text == "yes") return true;
  if (text == "false" || text == "off" || text == "no") return false;
  throw std::invalid_argument("'" + text + "' is not true or false");
}

// Every option, once: its TOML key (the flag is "--" and the key with '-'
// for '_', unless `flag` names another), its help, and how a value given as
// text is applied. A value that does not parse throws
// std::invalid_argument saying what was wrong with it.
struct Option {
  const char* key;
  const char* flag;  // nullptr: from the key
  const char* help;
  void (*apply)(CoordinatorOptions&, const std::string&);

  std::string flag_name() const {
    if (flag) return flag;
    std::string f = std::string("--") + key;
    for (char& c : f) c = c == '_' ? '-' : c;
    return f;
  }
};

using O = CoordinatorOptions;
using V = const std::string&;

const std::vector<Option>& options() {
  static const std::vector<Option> table{
      {"endpoint", nullptr,
       "ZeroMQ endpoint to bind (default: $LEASEHOLD_ENDPOINT or an ipc:// socket in the runtime "
       "directory)",
       [](O& o, V v) { o.endpoint = v; }},
      {"events_endpoint", nullptr,
       "PUB endpoint for job events (default: next to the ipc endpoint)",
       [](O& o, V v) { o.events_endpoint = v; }},
      {"backend", nullptr, "auto|cuda|host (default auto)", [](O& o, V v) { o.backend = v; }},
      {"devices", nullptr, "CUDA devices to serve, a pool each: all (default) or ordinals (0,2,3)",
       [](O& o, V v) { o.devices = parse_devices(v); }},
      {"device", nullptr, "one CUDA device to serve (the same as --devices N)",
       [](O& o, V v) { o.devices = {parse_ordinal(v)}; }},
      {"host_devices", nullptr,
       "host backend: this many devices, each a shared-memory segment of pool_size (default 1)",
       [](O& o, V v) { o.host_devices = static_cast<int>(parse_count(v, kMaxDevices)); }},
      {"pool_size", nullptr,
       "pool size of each device: bytes with a unit (4GiB) or a share of its free memory (90%); "
       "one for all, or one per device (40GiB,60GiB)",
       [](O& o, V v) { o.pool_size = parse_pool_sizes(v); }},
      {"alignment", nullptr, "lease alignment (default 2MiB)",
       [](O& o, V v) { o.alignment = parse_bytes(v); }},
      {"heartbeat_interval", nullptr, "agent heartbeat interval (default 1s)",
       [](O& o, V v) { o.heartbeat_interval = parse_duration(v); }},
      {"silence_limit", nullptr,
       "how long an agent whose process runs may stay silent (the coordinator's own stalls not "
       "counted) before its leases are fenced and its job given up (default 10s)",
       [](O& o, V v) { o.silence_limit = parse_duration(v); }},
      {"lease_wait_timeout", nullptr,
       "default time a lease request may wait for memory (default 30s)",
       [](O& o, V v) { o.lease_wait_timeout = parse_duration(v); }},
      {"state_dir", nullptr,
       "where jobs and checkpoints are stored (default: $STATE_DIRECTORY, "
       "$XDG_STATE_HOME/leasehold, ~/.local/state/leasehold or /var/lib/leasehold)",
       [](O& o, V v) { o.state_dir = v; }},
      {"recovery_grace", nullptr,
       "how long a running job waits for its agent after a restart or a silence, and a silent "
       "agent whose process lives has before it is ended (default 10s)",
       [](O& o, V v) { o.recovery_grace = parse_duration(v); }},
      {"end_silent_agents", nullptr,
       "true|false: SIGKILL an agent of the coordinator's own user that stays silent for "
       "recovery_grace after its leases were fenced while its process lives (stopped, hung), so "
       "its memory can be reused; false: that memory stays fenced until it exits (default true)",
       [](O& o, V v) { o.end_silent_agents = parse_bool(v); }},
      {"job_retention_count", nullptr, "finished jobs kept in the store (default 1000)",
       [](O& o, V v) { o.job_retention_count = parse_count(v); }},
      {"job_retention_age", nullptr, "finished jobs older than this are pruned (default 30d)",
       [](O& o, V v) { o.job_retention_age = parse_duration(v); }},
      {"policy", nullptr,
       "scheduling policy: occupancy (default) or fifo (first come, first served)",
       [](O& o, V v) { o.policy = v; }},
      {"low_watermark", nullptr,
       "jobs grow past their guaranteed share only below this occupancy (default 80%)",
       [](O& o, V v) { o.low_watermark = parse_fraction(v); }},
      {"high_watermark", nullptr, "above this occupancy agents are asked to shrink (default 95%)",
       [](O& o, V v) { o.high_watermark = parse_fraction(v); }},
      {"shrink_timeout", nullptr, "how long an agent asked to shrink has to answer (default 10s)",
       [](O& o, V v) { o.shrink_timeout = parse_duration(v); }},
      {"queued_per_user", nullptr, "jobs one user may have queued (default 1000)",
       [](O& o, V v) { o.queued_per_user = parse_count(v); }},
      {"job_epochs_kept", nullptr, "epoch results kept per job, the latest (default 1000)",
       [](O& o, V v) { o.job_epochs_kept = parse_count(v); }},
      {"job_history_kept", nullptr, "state changes kept per job, the latest (default 100)",
       [](O& o, V v) { o.job_history_kept = parse_count(v); }},
      {"waiting_per_agent", nullptr,
       "lease requests one agent may have waiting for memory (default 64)",
       [](O& o, V v) { o.waiting_per_agent = parse_count(v); }},
      {"max_lease_wait", nullptr,
       "the longest a lease or region request may ask to wait for memory; one asking longer is "
       "refused (default 24h)",
       [](O& o, V v) { o.max_lease_wait = parse_duration(v); }},
      {"max_epochs", nullptr, "the most epochs a job may ask for (default 100000)",
       [](O& o, V v) { o.max_epochs = parse_count(v); }},
      {"max_steps", nullptr, "the most steps a job may ask for (default 1000000000)",
       [](O& o, V v) { o.max_steps = parse_count(v, 1000000000000); }},
      {"malformed_limit", nullptr,
       "malformed messages after which a connection is ignored (default 100)",
       [](O& o, V v) { o.malformed_limit = parse_count(v); }},
      {"assign_timeout", nullptr,
       "an assignment an agent does not acknowledge by then goes back to the queue and the agent "
       "gets no more jobs in its session (default 10s)",
       [](O& o, V v) { o.assign_timeout = parse_duration(v); }},
      {"stop_timeout", nullptr,
       "a cancelled job its agent has not ended by then is marked cancelled anyway and the agent "
       "gets no more jobs in its session (default 60s)",
       [](O& o, V v) { o.stop_timeout = parse_duration(v); }},
      {"agent_group", nullptr,
       "only members of this group (and root, and the coordinator's user) may register as agents "
       "(default: only root and the coordinator's user; \"*\": anyone who can reach the socket)",
       [](O& o, V v) { o.agent_group = v; }},
      {"client_group", nullptr,
       "only members of this group (and root) may submit jobs and drop regions",
       [](O& o, V v) { o.client_group = v; }},
      {"program_group", nullptr,
       "only members of this group (and root, and the coordinator's user) may submit program "
       "jobs, which run their own code as the agents' user (default: only root and the "
       "coordinator's user; \"*\": everyone who may submit jobs)",
       [](O& o, V v) { o.program_group = v; }},
      {"admin_group", nullptr,
       "members may cancel anyone's job (a submitter may always cancel their own)",
       [](O& o, V v) { o.admin_group = v; }},
      {"socket_mode", nullptr,
       "octal mode of the ipc:// socket files: who may connect (default 0660)",
       [](O& o, V v) { o.socket_mode = parse_mode(v); }},
      {"socket_group", nullptr,
       "group of the ipc:// socket files and of a socket folder the coordinator creates "
       "(default: the coordinator's)",
       [](O& o, V v) { o.socket_group = v; }},
      {"curve_key", nullptr,
       "the coordinator's CURVE key pair file (`leasehold keygen`): required for tcp:// endpoints",
       [](O& o, V v) { o.curve_key = v; }},
      {"curve_allowed_keys", nullptr,
       "directory of the .pub files of clients and agents allowed over tcp://",
       [](O& o, V v) { o.curve_allowed_keys = v; }},
      {"mps", nullptr,
       "auto|on|off: run the GPU work under an MPS daemon the coordinator starts (default auto: "
       "when the cuda backend is used and nvidia-cuda-mps-control is on the PATH)",
       [](O& o, V v) { o.mps = v; }},
      {"mps_directory", nullptr,
       "pipe folder of an MPS daemon someone else runs (instead of starting one)",
       [](O& o, V v) { o.mps_directory = v; }},
      {"fault_probation", nullptr,
       "under MPS, after a device fault shared by several jobs: how long each runs alone before "
       "others run beside it, unless it finishes an epoch first (default 30s)",
       [](O& o, V v) { o.fault_probation = parse_duration(v); }},
      {"http_listen", "--http",
       "HOST:PORT of the read-only HTTP endpoint (dashboard page, /metrics, /api/...), or off "
       "(default 127.0.0.1:9464)",
       [](O& o, V v) { o.http_listen = v; }},
      {"log_level", nullptr, "trace|debug|info|warn|error (default info)",
       [](O& o, V v) { o.log_level = v; }},
  };
  return table;
}

// A TOML value as the text a flag would carry.
std::string as_text(const toml::node& node, const std::string& key, const std::string& source) {
  if (auto s = node.value<std::string>()) return *s;
  // (value<bool>() would take a number too.)
  if (const auto* b = node.as_boolean()) return b->get() ? "true" : "false";
  if (auto i = node.value<int64_t>()) {
    // TOML's octal integers (socket_mode = 0o660) stay octal.
    if (key == "socket_mode") {
      char octal[32];
      std::snprintf(octal, sizeof octal, "%llo", static_cast<unsigned long long>(*i));
      return *i < 0 ? std::to_string(*i) : std::string(octal);
    }
    return std::to_string(*i);
  }
  if (auto d = node.value<double>()) {
    std::ostringstream out;
    out << *d;
    return out.str();
  }
  // An array (devices = [0, 1], pool_size = ["40GiB", "60%"]) as the
  // comma-separated list a flag would carry.
  const bool list_key = key == "devices" || key == "pool_size";
  if (const auto* array = node.as_array(); list_key && array && !array->empty()) {
    std::string joined;
    for (const auto& item : *array) {
      if (item.is_array() || item.is_table()) break;
      joined += (joined.empty() ? "" : ",") + as_text(item, key, source);
    }
    if (!joined.empty()) return joined;
  }
  throw std::invalid_argument(source + ": key '" + key + "' must be a string, a number" +
                              (list_key ? ", or a list of them" : " or a boolean"));
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
  if (doc.contains("device") && doc.contains("devices")) {
    throw std::invalid_argument(source + ": give devices or device (one device), not both");
  }
  for (const auto& [k, node] : doc) {
    const std::string key(k.str());
    const std::string value = as_text(node, key, source);
    const Option* option = nullptr;
    for (const auto& o : options()) {
      if (key == o.key) option = &o;
    }
    try {
      if (!option) {
        std::string known;
        for (const auto& o : options()) known += (known.empty() ? "" : ", ") + std::string(o.key);
        throw std::invalid_argument("unknown key (known: " + known + ")");
      }
      option->apply(opts, value);
    } catch (const std::exception& e) {
      throw std::invalid_argument(source + ": key '" + key + "': " + e.what());
    }
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
  if (opts.host_devices < 1) throw std::invalid_argument("host_devices must be at least 1");
  if (opts.pool_size.empty()) throw std::invalid_argument("pool_size is empty");
  if (opts.pool_size.size() > 1 && !opts.devices.empty() &&
      opts.pool_size.size() != opts.devices.size()) {
    throw std::invalid_argument("pool_size lists " + std::to_string(opts.pool_size.size()) +
                                " sizes for " + std::to_string(opts.devices.size()) +
                                " devices: give one for all, or one per device");
  }
  if (opts.http_listen != "off") parse_http_listen(opts.http_listen);
  if (!is_power_of_two(opts.alignment) || opts.alignment < 256) {
    throw std::invalid_argument("alignment " + std::to_string(opts.alignment) +
                                " must be a power of two of at least 256 bytes");
  }
  for (const SizeSpec& size : opts.pool_size) {
    if (size.percent == 0 && size.bytes < opts.alignment) {
      throw std::invalid_argument("pool_size " + size.to_string() +
                                  " is smaller than the alignment");
    }
  }
  if (opts.heartbeat_interval.count() < 10) {
    throw std::invalid_argument("heartbeat_interval must be at least 10ms");
  }
  if (opts.silence_limit < 2 * opts.heartbeat_interval) {
    throw std::invalid_argument("silence_limit (" + std::to_string(opts.silence_limit.count()) +
                                " ms) must be at least two heartbeat intervals (" +
                                std::to_string(2 * opts.heartbeat_interval.count()) + " ms)");
  }
  if (opts.silence_limit.count() > UINT32_MAX / 2) {
    throw std::invalid_argument("silence_limit must be at most 24 days");
  }
  if (opts.lease_wait_timeout.count() < 0) {
    throw std::invalid_argument("lease_wait_timeout must not be negative");
  }
  // Requests carry their wait as 32-bit milliseconds.
  if (opts.max_lease_wait.count() < 1 || opts.max_lease_wait.count() > INT32_MAX) {
    throw std::invalid_argument("max_lease_wait must be between 1ms and " +
                                std::to_string(INT32_MAX / 86400000) + " days");
  }
  if (opts.lease_wait_timeout > opts.max_lease_wait) {
    throw std::invalid_argument("lease_wait_timeout (" +
                                std::to_string(opts.lease_wait_timeout.count()) +
                                " ms) is longer than max_lease_wait (" +
                                std::to_string(opts.max_lease_wait.count()) + " ms)");
  }
  if (opts.state_dir.empty()) throw std::invalid_argument("state_dir is empty");
  if (opts.state_dir.front() != '/') {
    // Jobs' default checkpoint folders are in it, and agents with other
    // working folders must find them.
    throw std::invalid_argument("state_dir '" + opts.state_dir + "' is not an absolute path");
  }
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
  if (opts.assign_timeout.count() <= 0)
    throw std::invalid_argument("assign_timeout must be positive");
  // A cancelled job's agent may be waiting for a lease, which no StopJob
  // interrupts: it must have time to get its answer and stop.
  if (opts.stop_timeout <= opts.lease_wait_timeout + 2 * opts.heartbeat_interval) {
    throw std::invalid_argument("stop_timeout (" + std::to_string(opts.stop_timeout.count()) +
                                " ms) must be longer than lease_wait_timeout (" +
                                std::to_string(opts.lease_wait_timeout.count()) +
                                " ms) and two heartbeat intervals");
  }
  for (const std::string& e : {opts.endpoint, opts.events_endpoint}) {
    if (needs_curve(e) && (opts.curve_key.empty() || opts.curve_allowed_keys.empty())) {
      throw std::invalid_argument(
          e +
          " is a network endpoint, which Leasehold serves only with CURVE: set curve_key "
          "(a key pair file from `leasehold keygen`) and curve_allowed_keys (a directory of the "
          "clients' and agents' .pub files)");
    }
  }
}

CoordinatorOptions parse_coordinator_options(int argc, char** argv) {
  CLI::App app{"leasehold-coordinator: owns a GPU (or host) memory pool and leases it to agents"};
  std::optional<std::string> config, test_stall;
  app.add_option("--config", config, "TOML configuration file")->check(CLI::ExistingFile);
  std::vector<std::optional<std::string>> given(options().size());
  for (size_t i = 0; i < options().size(); ++i) {
    app.add_option(options()[i].flag_name(), given[i], options()[i].help);
  }
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
    auto given_key = [&](std::string_view key) {
      for (size_t i = 0; i < options().size(); ++i) {
        if (options()[i].key == key) return given[i].has_value();
      }
      return false;
    };
    if (given_key("device") && given_key("devices")) {
      throw std::invalid_argument("give --devices or --device (one device), not both");
    }
    for (size_t i = 0; i < options().size(); ++i) {
      if (!given[i]) continue;
      try {
        options()[i].apply(opts, *given[i]);
      } catch (const std::exception& e) {
        throw std::invalid_argument(options()[i].flag_name() + ": " + e.what());
      }
    }
    if (opts.events_endpoint.empty()) opts.events_endpoint = default_events_endpoint(opts.endpoint);
    if (!opts.state_dir.empty() && opts.state_dir.front() != '/') {
      opts.state_dir = std::filesystem::absolute(opts.state_dir).string();
    }
    if (test_stall) opts.test_stall_on_sigusr1 = parse_duration(*test_stall);
    validate(opts);
  } catch (const std::exception& e) {
    std::cerr << "leasehold-coordinator: " << e.what() << "\n";
    std::exit(2);
  }
  return opts;
}

}  // namespace leasehold
