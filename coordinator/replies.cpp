#include "coordinator/replies.h"

namespace leasehold {

flatbuffers::Offset<proto::Lease> build_lease(flatbuffers::FlatBufferBuilder& fbb,
                                              const LeaseRecord& rec) {
  auto owner = fbb.CreateString(rec.owner);
  auto end = rec.end == PoolAllocator::End::High ? proto::LeaseEnd::High : proto::LeaseEnd::Low;
  return proto::CreateLease(fbb, rec.id, owner, rec.offset, rec.size, end, rec.generation);
}

flatbuffers::Offset<proto::PoolInfo> build_pool_info(flatbuffers::FlatBufferBuilder& fbb,
                                                     const PoolDescriptor& desc) {
  auto name = fbb.CreateString(desc.device_name);
  auto handle = fbb.CreateVector(desc.handle);
  auto backend = desc.backend == Backend::Cuda ? proto::Backend::Cuda : proto::Backend::Host;
  return proto::CreatePoolInfo(fbb, backend, desc.device, name, desc.size, desc.alignment, handle,
                               desc.epoch);
}

}  // namespace leasehold
