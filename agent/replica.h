// A data-parallel job's replica, as its assignment names it
// (AssignJob.rank, world_size, master_addr, master_port): which of the
// gang's replicas this agent runs, and where rank 0 serves the replicas'
// rendezvous. A plain job is rank 0 of 1.
#pragma once

#include <cstdint>
#include <string>

namespace leasehold {

struct Replica {
  int rank = 0;
  int world_size = 1;
  std::string master_addr;
  uint16_t master_port = 0;
  bool data_parallel() const { return world_size > 1; }
};

}  // namespace leasehold
