// Exercise mode of leasehold-agent: lease memory, write a pattern unique to
// this agent into it, and keep checking that it stays intact while other
// agents do the same. It proves the leases of different agents never overlap
// and that the pool is really shared memory. Prints one line per event.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <optional>

#include "lease_client/session.h"

namespace leasehold {

struct ExerciseOptions {
  int leases = 2;                          // leases held at once
  uint64_t lease_size = 4ull << 20;        // bytes per lease
  int rounds = 10;                         // verify rounds; 0 = until stopped
  std::chrono::milliseconds interval{200}; // between rounds
  // Release every lease after each verified round and lease anew: the
  // agent keeps taking whatever memory the pool frees (a neighbour that
  // would notice memory handed out while its old owner still writes).
  bool churn = false;
  // Fault injection for tests: once its leases are held, write a pattern
  // over this many bytes at this pool offset, outside its leases (what a
  // buggy kernel does). With isolation it faults in this process alone.
  std::optional<uint64_t> stray_write_offset;
  uint64_t stray_write_bytes = 1ull << 20;
};

// Exit status: 0 when every round verified, 3 when a lease's content changed
// under it, 4 when the stray write of the fault injection faulted. Leases lost to a coordinator restart are acquired again.
int run_exercise(AgentSession& session, const ExerciseOptions& opts,
                 const std::atomic<bool>& stop);

}  // namespace leasehold
