// The plug-in's state (libleasehold_torch.so, docs/torch-plugin.md): the
// job's session with the coordinator and the block cache on its leases,
// opened at the first allocation, and the plug-in's messages.
//
// State lives in one Plugin object created at the first call and never
// destroyed: PyTorch frees tensors during interpreter shutdown, after static
// destructors may have run, and the shrink worker thread must never be
// joined from a destructor.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <utility>

#include "leasehold.h"
#include "torch_plugin/block_cache.h"
#include "torch_plugin/messages.h"

namespace leasehold::torch_plugin {

// ---- the state ------------------------------------------------------------------

struct Plugin {
  std::mutex init_mu;
  std::atomic<BlockCache*> cache{nullptr};
  std::string init_error;  // GUARDED_BY(init_mu): why the session could not be opened (sticky)

  // Set once before `cache` is published; read-only afterwards.
  lh_session* session = nullptr;
  StreamOps* streams = nullptr;  // the cache's
  int device = -1;
  uint64_t budget = 0;
  uint64_t guaranteed = 0;  // the job's guaranteed share (0: none known)

  std::atomic<bool> lost{false};
  // Allocations answered out of memory (leasehold_torch_stats).
  std::atomic<uint64_t> refused{0};
  std::mutex lost_mu;
  std::string lost_reason;    // GUARDED_BY(lost_mu)
  bool lost_printed = false;  // GUARDED_BY(lost_mu)

  // The pressure handler (leasehold_torch_set_pressure_handler).
  std::mutex pressure_mu;
  uint64_t (*pressure_fn)(uint64_t, void*) = nullptr;  // GUARDED_BY(pressure_mu)
  void* pressure_ctx = nullptr;                         // GUARDED_BY(pressure_mu)

  // Shrink requests waiting for the shrink worker (shrink_worker.h).
  std::mutex shrink_mu;
  std::condition_variable shrink_cv;
  std::deque<std::pair<uint64_t, uint64_t>> shrinks;  // GUARDED_BY(shrink_mu): (id, bytes)

  // Notes that the session is lost (the first reason is kept).
  void note_lost(const std::string& reason);
  // The error for allocations once the session is lost; printed once.
  std::string lost_message();
};

// The one Plugin, created at the first call; never destroyed.
Plugin& plugin();

// LEASEHOLD_BUDGET: decimal bytes; 0 when unset. Throws std::runtime_error
// naming the variable when it is not a byte count.
uint64_t budget_from_env();
// LEASEHOLD_GUARANTEED (the job's guaranteed share, memory_min), the same way.
uint64_t guaranteed_from_env();
// The most one lease of the job holds (session_leases.h): small enough that
// free stretches of a partly used segment go back at a Shrink, large
// enough that a segment of a few GiB takes tens of requests, not thousands.
inline constexpr uint64_t kLeasePiece = uint64_t{64} << 20;

// The cache, opening the job's session at the first call: its settings
// from the environment the agent sets, its pool (which must be the CUDA
// backend's), the budget (LEASEHOLD_BUDGET, else the session's), and the
// shrink worker. Throws std::runtime_error with a "leasehold: ..." message
// when the session cannot be had; that failure is sticky (every later call
// throws it again, without retrying).
BlockCache* open_cache(Plugin& p);

// Asks the pressure handler, if one is set, to free about `bytes`; the
// bytes it says it freed (0: none, no handler, or called from within the
// handler on this thread). Never throws: a handler's failure is printed.
uint64_t relieve_pressure(Plugin& p, uint64_t bytes);

// The self-fence (lease_client/leasehold.h): while the coordinator has not
// answered recently enough, nothing new is handed out of the leases; the
// program pauses in this allocation until the coordinator answers again
// (true) or the session is lost (false, noted).
bool wait_may_touch(Plugin& p);

}  // namespace leasehold::torch_plugin
