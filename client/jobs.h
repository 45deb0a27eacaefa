// The client's job commands. Exit codes: 0 success (a followed job
// succeeded), 1 the followed job failed, 2 invalid input (bad job file,
// unknown job), 3 the followed job was cancelled, 4 the coordinator could
// not be reached or answered with an error.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "shared/curve_keys.h"

namespace leasehold::client {

struct Context {
  std::string endpoint;
  std::string events_endpoint;
  std::optional<CurveClientKeys> curve;  // for a network endpoint
  std::chrono::milliseconds timeout{3000};
  bool json = false;
};

struct SubmitOverrides {
  std::optional<int> priority;
  std::optional<int> epochs;  // replaces epochs (and clears steps)
};
int submit(const Context& ctx, const std::string& file, bool follow,
           const SubmitOverrides& overrides);
int list_jobs(const Context& ctx);
int show_job(const Context& ctx, uint64_t id);
int cancel_job(const Context& ctx, uint64_t id);
int logs(const Context& ctx, uint64_t id, bool follow);

}  // namespace leasehold::client
