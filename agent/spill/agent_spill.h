// What an agent sets aside for spilling once, at start: the pinned host
// tier (`host_bytes`) and the staging ring of the spill file (both
// allocated here, never on a job's hot path: pinning memory synchronizes
// the device), the copy stream, and the spill directory, from which the
// spill files of crashed agents are removed. Each job then gets its own
// SpillManager and store over these, with its own spill file that is
// removed when the job ends.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "agent/engine/allocator.h"
#include "agent/spill/spill_manager.h"
#include "agent/spill/transfer.h"
#include "schemas/job_generated.h"

namespace leasehold::spill {

struct SpillConfig {
  uint64_t host_bytes = 256ull << 20;    // pinned host tier (0: none)
  uint64_t staging_bytes = 64ull << 20;  // staging ring of the spill file
  std::string directory;  // chosen (--spill-dir): created, or the agent does not start
  // Used when `directory` is empty (the agent's state folder's spill/): a
  // place that cannot be made only costs the spill file, with a warning.
  std::string default_directory;
  uint64_t file_limit = 0;               // most bytes one spill file may hold (0: the disk)
  int io_threads = 4;
  // Throws std::invalid_argument naming the setting that cannot work.
  void validate() const;
};

class AgentSpill {
 public:
  // Allocates the host tier and the staging ring for `device` and creates
  // the directory (removing stale spill files). Throws std::runtime_error
  // naming what failed.
  AgentSpill(SpillConfig config, engine::Device device);

  // A spill manager for one job (`tag` names its spill file), over
  // `allocator`; nullptr when the job turned spilling off.
  std::shared_ptr<SpillManager> for_job(const proto::JobSpec& job, const std::string& tag,
                                        std::shared_ptr<engine::Allocator> allocator);

  const SpillConfig& config() const { return config_; }

 private:
  SpillConfig config_;
  std::shared_ptr<Transfer> transfer_;
  PinnedBuffer host_tier_;
  PinnedBuffer staging_;
};

}  // namespace leasehold::spill
