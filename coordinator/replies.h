// Builders for the coordinator's reply bodies (FlatBuffers offsets).
#pragma once

#include <flatbuffers/flatbuffers.h>

#include "coordinator/lease_table.h"
#include "schemas/leasehold_generated.h"
#include "shared/device.h"

namespace leasehold {

flatbuffers::Offset<proto::Lease> build_lease(flatbuffers::FlatBufferBuilder& fbb,
                                              const LeaseRecord& rec);
flatbuffers::Offset<proto::PoolInfo> build_pool_info(flatbuffers::FlatBufferBuilder& fbb,
                                                     const PoolDescriptor& desc);

}  // namespace leasehold
