// Device memory an agent holds outside the pool: its CUDA context, the
// cuBLAS workspace, loaded kernel modules, streams. Shown in `leasehold
// status` (OUTSIDE POOL) so an operator can size the pool for the agents
// beside it.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

#include "agent/engine/dtype.h"

namespace leasehold {

struct Footprint {
  uint64_t bytes = 0;
  std::string method;  // how it was measured, for the log
};

// Construct before the warm-up (the pool is mapped, so the context exists),
// measure() after it. NVML's figure for this process is used where the
// driver's library gives one (not inside a PID namespace, nor under MPS);
// else the drop in the device's free memory across the warm-up, which
// leaves out the context itself. Nothing on the host backend.
class FootprintProbe {
 public:
  explicit FootprintProbe(engine::Device device);
  Footprint measure() const;

 private:
  engine::Device device_;
  uint64_t free_before_ = 0;
};

// Device memory that process `pid` (a program job's child) allocated itself,
// as NVML counts it: its CUDA context and whatever it allocated around the
// leases (memory mapped from the pool is the coordinator's). nullopt where
// NVML has no figure (no driver library, a PID namespace, MPS, the host
// backend).
std::optional<uint64_t> process_device_bytes(engine::Device device, pid_t pid);

}  // namespace leasehold
