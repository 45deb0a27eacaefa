// Builders for the coordinator's reply bodies (FlatBuffers offsets).
#pragma once

#include <flatbuffers/flatbuffers.h>

#include "coordinator/job_table.h"
#include "coordinator/lease_table.h"
#include "schemas/leasehold_generated.h"
#include "shared/device.h"

namespace leasehold {

flatbuffers::Offset<proto::Lease> build_lease(flatbuffers::FlatBufferBuilder& fbb,
                                              const LeaseRecord& rec);
flatbuffers::Offset<proto::PoolInfo> build_pool_info(flatbuffers::FlatBufferBuilder& fbb,
                                                     const PoolDescriptor& desc);

// `with_spec`: include the full job specification (for `leasehold job ID`).
flatbuffers::Offset<proto::JobInfo> build_job_info(flatbuffers::FlatBufferBuilder& fbb,
                                                   const JobRecord& job, bool with_spec);

}  // namespace leasehold
