// Standby warm-up: what a job needs, prepared before any job arrives, so
// that nothing on the path from assignment to first step creates or loads
// anything. On the thread that will run the jobs (streams and cuBLAS
// handles are per thread): the compute stream, the cuBLAS handle and its
// workspace, and every engine kernel a job uses (one small launch each:
// CUDA loads a kernel's module on its first launch), through a tiny model
// with every layer type trained a step with both optimisers and evaluated,
// plus the example MLP's matrix shapes; on the CPU the same warms
// OpenBLAS's threads. The memory it uses is outside the pool and given back
// afterwards (except what CUDA and cuBLAS keep: see device_footprint.h).
#pragma once

#include "agent/engine/dtype.h"

namespace leasehold {

// Throws (a CUDA error, out of memory) when the device cannot run a job.
void warm_up(engine::Device device);

}  // namespace leasehold
