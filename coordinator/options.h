// The coordinator's options: built-in defaults, overridden by the TOML file,
// then by the environment (LEASEHOLD_ENDPOINT), then by flags.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

#include "shared/units.h"

namespace leasehold {

struct CoordinatorOptions {
  // Where the ROUTER socket binds. Default: see shared/endpoint.h.
  std::string endpoint;
  // Where job events are published (PUB). Default: the endpoint's ipc path
  // with ".events" in place of ".sock" (required for other transports).
  std::string events_endpoint;
  // auto | cuda | host. auto picks cuda when a GPU is visible.
  std::string backend = "auto";
  // CUDA device ordinal the pool lives on (ignored on host).
  int device = 0;
  // Pool size: bytes, or a share of the device's free memory at start.
  SizeSpec pool_size{0, 80.0};
  // Every lease offset and size is a multiple of this. 2 MiB matches the
  // GPU's large-page granularity; smaller values waste less on small leases.
  uint64_t alignment = 2ull << 20;
  // Agents heart-beat at this interval; one silent for two intervals is
  // declared dead and its leases reclaimed (within three intervals at most).
  std::chrono::milliseconds heartbeat_interval{1000};
  // How long a lease request that does not fit may wait by default.
  std::chrono::milliseconds lease_wait_timeout{30000};
  std::string log_level = "info";
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

// The events endpoint that goes with `endpoint` when none is configured
// (also used by the client); empty when it cannot be derived.
std::string default_events_endpoint(const std::string& endpoint);

}  // namespace leasehold
