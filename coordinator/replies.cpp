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

flatbuffers::Offset<proto::JobInfo> build_job_info(flatbuffers::FlatBufferBuilder& fbb,
                                                   const JobRecord& job, bool with_spec) {
  std::vector<flatbuffers::Offset<proto::StateChange>> history;
  for (const auto& h : job.history) history.push_back(proto::StateChange::Pack(fbb, &h));
  std::vector<flatbuffers::Offset<proto::EpochStat>> epochs;
  for (const auto& e : job.epochs) epochs.push_back(proto::EpochStat::Pack(fbb, &e));
  auto progress = proto::Progress::Pack(fbb, &job.progress);
  auto spec = with_spec ? proto::JobSpec::Pack(fbb, job.spec.get()) : 0;
  return proto::CreateJobInfo(fbb, job.id, fbb.CreateString(job.name),
                              fbb.CreateString(job_state_name(job.state)),
                              fbb.CreateString(job.agent), job.priority, job.submitted_ms,
                              fbb.CreateVector(history), progress, fbb.CreateVector(epochs),
                              job.test_accuracy, job.samples_per_second,
                              fbb.CreateString(job.reason), spec);
}

}  // namespace leasehold
