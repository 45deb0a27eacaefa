// What the broker does once, at start: the checks and pieces it is built
// from (coordinator/broker.h). Each throws std::runtime_error naming the
// cause.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <zmq.hpp>

#include "coordinator/core.h"
#include "coordinator/mps_daemon.h"
#include "coordinator/options.h"

namespace leasehold {

// Refuses to start when another coordinator answers at `endpoint`: binding an
// ipc:// endpoint would silently take its socket away. (A taken tcp:// port
// fails to bind instead.)
void ensure_no_live_coordinator(zmq::context_t& ctx, const std::string& endpoint);

// One coordinator per state directory: two would hand out the same job ids.
// Makes it (and its checkpoints/ folder) mode 0700, or 0750 of `group`
// (the socket group; -1: none), whatever the umask. Returns the descriptor
// holding the lock (it goes with the process, so a crashed coordinator
// leaves none).
int lock_state_dir(const std::string& dir, gid_t group);

// The largest job id that has a checkpoint folder under STATE_DIR/checkpoints.
// A store moved away (or lost) must not make a new job take the id, and so
// resume the checkpoint, of an old one.
uint64_t largest_checkpoint_id(const std::string& state_dir);

// The MPS daemon to run under (null: none), per the mps options. Before the
// first CUDA call.
std::unique_ptr<MpsDaemon> start_mps(const CoordinatorOptions& o);

CoreOptions core_options(const CoordinatorOptions& o);
std::unique_ptr<SchedulingPolicy> make_policy(const CoordinatorOptions& o);

}  // namespace leasehold
