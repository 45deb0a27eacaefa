#include "coordinator/replies.h"

namespace leasehold {

std::unique_ptr<proto::LeaseT> lease_object(const LeaseRecord& rec, int device) {
  auto l = std::make_unique<proto::LeaseT>();
  l->id = rec.id;
  l->agent = rec.owner.name;
  switch (rec.owner.kind) {
    case LeaseOwner::Kind::Agent:
      l->holder = proto::LeaseHolder::Agent;
      break;
    case LeaseOwner::Kind::Fenced:
      l->holder = proto::LeaseHolder::Fenced;
      break;
    case LeaseOwner::Kind::Region:
      l->holder = proto::LeaseHolder::Region;
      break;
    case LeaseOwner::Kind::Renewing:
      l->holder = proto::LeaseHolder::Renewing;
      break;
  }
  l->device = device;
  l->offset = rec.offset;
  l->size = rec.size;
  l->end = rec.end == PoolAllocator::End::High ? proto::LeaseEnd::High : proto::LeaseEnd::Low;
  l->generation = rec.generation;
  return l;
}

std::unique_ptr<proto::PoolInfoT> pool_info_object(const PoolDescriptor& desc) {
  auto p = std::make_unique<proto::PoolInfoT>();
  p->backend = desc.backend == Backend::Cuda ? proto::Backend::Cuda : proto::Backend::Host;
  p->device = desc.device;
  p->device_name = desc.device_name;
  p->size = desc.size;
  p->alignment = desc.alignment;
  p->epoch = desc.epoch;
  p->uuid = desc.uuid;
  return p;
}

void send_error(Effects& out, const std::string& to, uint64_t request_id, ErrorCode code,
                const std::string& message, bool after_store) {
  proto::ErrorT e;
  e.code = code;
  e.message = message;
  send(out, to, request_id, std::move(e), after_store);
}

void send_ack(Effects& out, const std::string& to, uint64_t request_id, bool after_store) {
  send(out, to, request_id, proto::AckT{}, after_store);
}

}  // namespace leasehold
