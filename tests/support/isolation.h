// The lease-isolation scenario shared by the host and CUDA integration tests:
// several agent processes lease memory from one pool, write their own
// patterns and verify them round after round.
#pragma once

#include <string>

#include "tests/support/cluster.h"

namespace leasehold::testing {

// Starts `agents` exercising agents on a running coordinator and checks that
// they hold disjoint leases and all verify every round.
void run_isolation_scenario(Cluster& cluster, int agents, const std::string& lease_size);

// Two agents exercise their leases while a third writes 1 MiB at the first
// one's lease offset, outside its own leases (a buggy kernel). The write
// faults in the writer's process alone (host: SIGSEGV; cuda: an illegal
// address in its own context) and both others verify every round.
void run_stray_write_scenario(Cluster& cluster, const std::string& lease_size);

}  // namespace leasehold::testing
