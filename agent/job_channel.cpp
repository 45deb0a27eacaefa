#include "agent/job_channel.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <utility>

#include "shared/protocol.h"

namespace leasehold {

JobChannel::~JobChannel() { set_handlers({}, {}, {}); }

void JobChannel::set_handlers(AssignHandler on_assign, StopHandler on_stop,
                              JobStates job_states) {
  session_.set_jobs_provider(std::move(job_states));
  if (!on_assign && !on_stop) {
    session_.set_push_handler({});
    return;
  }
  session_.set_push_handler([&session = session_, on_assign = std::move(on_assign),
                             on_stop = std::move(on_stop)](const proto::Envelope& env) {
    switch (env.body_type()) {
      case proto::Body::AssignJob: {
        auto job = parse_assignment(*env.body_as_AssignJob());
        if (!job) break;
        if (on_assign) on_assign(std::move(*job));
        // The next heartbeat lists the job: that is the acknowledgement.
        session.heartbeat_soon();
        break;
      }
      case proto::Body::StopJob: {
        const auto* s = env.body_as_StopJob();
        if (on_stop) on_stop(s->job_id(), s->attempt(), s->cancel(), std::string(str(s->reason())));
        session.heartbeat_soon();
        break;
      }
      default:
        break;
    }
  });
}

void JobChannel::send_update(const proto::JobUpdateT& update) {
  session_.request([&](flatbuffers::FlatBufferBuilder& fbb) {
    return std::pair{proto::Body::JobUpdate, proto::JobUpdate::Pack(fbb, &update).Union()};
  });
}

std::optional<JobAssignment> JobChannel::parse_assignment(const proto::AssignJob& a) {
  if (!a.spec()) return std::nullopt;
  // The spec arrives nested in the envelope: a standalone buffer of its own.
  std::unique_ptr<proto::JobSpecT> spec(a.spec()->UnPack());
  flatbuffers::FlatBufferBuilder fbb;
  fbb.Finish(proto::JobSpec::Pack(fbb, spec.get()));
  JobAssignment job;
  job.job_id = a.job_id();
  job.attempt = a.attempt();
  job.spec.assign(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
  job.checkpoint_owner = CheckpointOwner{a.private_checkpoint(), a.submitter_uid()};
  job.job_token = token_text(a.job_token_lo(), a.job_token_hi());
  job.replica.rank = a.rank();
  job.replica.world_size = std::max(1, a.world_size());
  job.replica.master_addr = a.master_addr() ? a.master_addr()->str() : "";
  job.replica.master_port = a.master_port();
  return job;
}

std::string JobChannel::token_text(uint64_t lo, uint64_t hi) {
  if ((lo | hi) == 0) return "";
  char text[33];
  std::snprintf(text, sizeof text, "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return text;
}

}  // namespace leasehold
