#include "agent/spill/agent_spill.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <system_error>

#include "agent/spill/tiered_store.h"
#include "shared/endpoint.h"
#include "shared/job_spec.h"
#include "shared/units.h"

namespace leasehold::spill {

void SpillConfig::validate() const {
  if (staging_bytes && staging_bytes < (2u << 20)) {
    throw std::invalid_argument("spill staging of " + format_bytes(staging_bytes) +
                                " is too small: 0 (no spill file) or at least 2 MiB (two 1 MiB "
                                "chunks)");
  }
  if (io_threads < 1) throw std::invalid_argument("spill I/O threads must be at least 1");
}

AgentSpill::AgentSpill(SpillConfig config, engine::Device device)
    : config_(std::move(config)), transfer_(make_transfer(device)) {
  config_.validate();
  bool chosen = !config_.directory.empty();
  if (!chosen) config_.directory = config_.default_directory;
  std::error_code ec;
  std::filesystem::create_directories(config_.directory, ec);
  if (ec && chosen) {
    throw std::runtime_error("cannot create spill directory " + config_.directory + ": " +
                             ec.message());
  }
  if (ec || config_.directory.empty()) {
    // The default place is not writable here: spill to host memory only.
    spdlog::warn("no spill file: cannot create the default spill directory {}: {} (set "
                 "--spill-dir)",
                 config_.directory, ec.message());
    config_.directory.clear();
  } else if (int n = remove_stale_spill_files(config_.directory); n > 0) {
    spdlog::warn("removed {} spill file(s) of crashed agents from {}", n, config_.directory);
  }
  if (config_.host_bytes) host_tier_ = PinnedBuffer(config_.host_bytes, device);
  if (config_.staging_bytes) staging_ = PinnedBuffer(config_.staging_bytes, device);
  spdlog::info("spill: host tier {}, staging {}, files in {}", format_bytes(config_.host_bytes),
               format_bytes(config_.staging_bytes),
               config_.directory.empty() ? std::string("(none)") : config_.directory);
}

std::shared_ptr<SpillManager> AgentSpill::for_job(const proto::JobSpec& job,
                                                  const std::string& tag,
                                                  std::shared_ptr<engine::Allocator> allocator) {
  const auto* s = job.spill();
  if (s && !s->enabled()) return nullptr;
  TieredStoreOptions o;
  o.host_tier = config_.host_bytes ? &host_tier_ : nullptr;
  // Absent: all of the agent's host tier; an explicit 0: none of it.
  if (s && s->host_bytes()) {
    o.host_limit = job_spill_host_bytes(job);
    if (o.host_limit == 0) o.host_tier = nullptr;
  }
  o.directory = s && s->directory() ? s->directory()->str() : config_.directory;
  o.staging = config_.staging_bytes && !o.directory.empty() ? &staging_ : nullptr;
  o.tag = tag;
  o.file_limit = config_.file_limit;
  o.io_threads = config_.io_threads;
  auto store = std::make_unique<TieredSpillStore>(*transfer_, o);
  return SpillManager::create(std::move(store), transfer_, std::move(allocator));
}

}  // namespace leasehold::spill
