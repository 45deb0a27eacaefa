// The client's job commands. Exit codes: client/exit_codes.h.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "schemas/job_generated.h"
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
// Reads, parses and validates a job file (all but its dataset files).
// Throws JobSpecError naming every problem.
std::unique_ptr<proto::JobSpecT> load_job_file(const std::string& file,
                                               const SubmitOverrides& overrides);
int submit(const Context& ctx, const proto::JobSpecT& spec, bool follow);
int list_jobs(const Context& ctx);
int show_job(const Context& ctx, uint64_t id);
int cancel_job(const Context& ctx, uint64_t id);
int logs(const Context& ctx, uint64_t id, bool follow);
// Fetches job `id`'s latest checkpoint (its owner's or an administrator's
// to fetch) into `output`, as the engine wrote it ("lhckpt") or converted
// to safetensors ("safetensors"; "auto": by the output's extension). The
// file appears whole or not at all, mode 0600.
int fetch_checkpoint(const Context& ctx, uint64_t id, const std::string& output,
                     const std::string& format);

}  // namespace leasehold::client
