// The coordinator's job handling: submission (validated again here), listing,
// cancellation, assignment of queued jobs to idle agents, the agents'
// progress reports, and job events on the PUB socket.
#include <spdlog/spdlog.h>

#include "agent/job_spec.h"
#include "coordinator/coordinator.h"
#include "coordinator/replies.h"
#include "shared/units.h"

namespace leasehold {
namespace {

// The spec as a standalone verified buffer, for validate_job.
std::vector<uint8_t> standalone(const proto::JobSpecT& spec) {
  flatbuffers::FlatBufferBuilder fbb;
  fbb.Finish(proto::JobSpec::Pack(fbb, &spec));
  return {fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize()};
}

bool device_fits(const std::string& job_device, Backend pool) {
  if (job_device == "cuda") return pool == Backend::Cuda;
  if (job_device == "cpu") return pool == Backend::Host;
  return true;
}

}  // namespace

void Coordinator::publish(const JobRecord& job) {
  flatbuffers::FlatBufferBuilder fbb(1024);
  auto info = build_job_info(fbb, job, false);
  finish_envelope(fbb, {0, "coordinator", 0}, proto::Body::JobInfo, info.Union());
  std::string topic = "job." + std::to_string(job.id) + ".";
  try {
    pub_.send(zmq::buffer(topic), zmq::send_flags::sndmore | zmq::send_flags::dontwait);
    pub_.send(to_message(fbb), zmq::send_flags::dontwait);
  } catch (const zmq::error_t& e) {
    spdlog::warn("could not publish an event for job {}: {}", job.id, e.what());
  }
}

void Coordinator::push_to_agent(const AgentRecord& agent, flatbuffers::FlatBufferBuilder& fbb) {
  // Every socket of the agent gets it; the agent's heartbeat thread acts on
  // it and ignores duplicates.
  for (const auto& rid : agent.routing_ids) reply(rid, to_message(fbb));
}

void Coordinator::on_submit(const std::string& rid, const proto::Envelope& env) {
  uint64_t req = env.header()->request_id();
  const auto* submit = env.body_as_SubmitJob();
  if (!submit->spec()) {
    return reply_error(rid, req, ErrorCode::InvalidArgument, "SubmitJob without a spec");
  }
  auto spec = std::shared_ptr<proto::JobSpecT>(submit->spec()->UnPack());
  try {
    auto buffer = standalone(*spec);
    validate_job(*verify_job(buffer), ValidationOptions{true, pool().size});
  } catch (const JobSpecError& e) {
    return reply_error(rid, req, ErrorCode::InvalidArgument, e.what());
  }
  if (!device_fits(spec->device.empty() ? "auto" : spec->device, pool().backend)) {
    return reply_error(rid, req, ErrorCode::InvalidArgument,
                       "device: job wants '" + spec->device + "' but this coordinator's pool is " +
                           backend_name(pool().backend));
  }
  uint64_t id = jobs_.submit(spec);
  spdlog::info("job {} '{}' queued (priority {})", id, spec->name, spec->priority);
  flatbuffers::FlatBufferBuilder fbb(128);
  finish_envelope(fbb, {req, "coordinator", 0}, proto::Body::JobAccepted,
                  proto::CreateJobAccepted(fbb, id).Union());
  reply(rid, to_message(fbb));
  publish(*jobs_.find(id));
  schedule();
}

void Coordinator::on_list_jobs(const std::string& rid, const proto::Envelope& env) {
  flatbuffers::FlatBufferBuilder fbb(4096);
  std::vector<flatbuffers::Offset<proto::JobInfo>> list;
  for (const auto& [id, job] : jobs_.all()) list.push_back(build_job_info(fbb, job, false));
  finish_envelope(fbb, {env.header()->request_id(), "coordinator", 0}, proto::Body::JobList,
                  proto::CreateJobList(fbb, fbb.CreateVector(list)).Union());
  reply(rid, to_message(fbb));
}

void Coordinator::on_get_job(const std::string& rid, const proto::Envelope& env) {
  uint64_t req = env.header()->request_id();
  const JobRecord* job = jobs_.find(env.body_as_GetJob()->job_id());
  if (!job) {
    return reply_error(rid, req, ErrorCode::InvalidArgument,
                       "no job with id " + std::to_string(env.body_as_GetJob()->job_id()));
  }
  flatbuffers::FlatBufferBuilder fbb(2048);
  auto info = build_job_info(fbb, *job, true);
  finish_envelope(fbb, {req, "coordinator", 0}, proto::Body::JobInfo, info.Union());
  reply(rid, to_message(fbb));
}

void Coordinator::on_cancel(const std::string& rid, const proto::Envelope& env) {
  uint64_t req = env.header()->request_id();
  uint64_t id = env.body_as_CancelJob()->job_id();
  JobRecord* job = jobs_.find(id);
  if (!job) {
    return reply_error(rid, req, ErrorCode::InvalidArgument, "no job with id " + std::to_string(id));
  }
  if (is_terminal(job->state)) {
    return reply_error(rid, req, ErrorCode::InvalidArgument,
                       "job " + std::to_string(id) + " already " + job_state_name(job->state));
  }
  if (job->state == JobState::Queued) {
    jobs_.set_state(*job, JobState::Cancelled, "cancelled while queued");
    publish(*job);
  } else {
    // The agent stops between steps, releases its leases and reports.
    job->stop_requested = true;
    auto it = agents_.find(job->agent);
    if (it != agents_.end()) {
      flatbuffers::FlatBufferBuilder fbb(128);
      finish_envelope(fbb, {0, "coordinator", 0}, proto::Body::StopJob,
                      proto::CreateStopJob(fbb, id).Union());
      push_to_agent(it->second, fbb);
    }
  }
  spdlog::info("job {} '{}': cancel requested ({})", id, job->name, job_state_name(job->state));
  reply_ack(rid, req, proto::Body::Ack);
}

void Coordinator::on_job_update(const std::string& rid, AgentRecord& agent,
                                const proto::Envelope& env) {
  uint64_t req = env.header()->request_id();
  const auto* u = env.body_as_JobUpdate();
  JobRecord* job = jobs_.find(u->job_id());
  if (!job || job->agent != agent.name) {
    return reply_error(rid, req, ErrorCode::NotOwner,
                       "job " + std::to_string(u->job_id()) + " is not running on agent '" +
                           agent.name + "'");
  }
  if (!jobs_.apply(*job, *u)) {
    return reply_error(rid, req, ErrorCode::InvalidArgument,
                       "job " + std::to_string(u->job_id()) + " cannot go from " +
                           job_state_name(job->state) + " to '" +
                           (u->state() ? u->state()->str() : "") + "'");
  }
  reply_ack(rid, req, proto::Body::Ack);
  if (is_terminal(job->state)) {
    agent.job_id = 0;
    spdlog::info("job {} '{}' {} on '{}'{}{}", job->id, job->name, job_state_name(job->state),
                 agent.name, job->reason.empty() ? "" : ": ", job->reason);
  }
  publish(*job);
  if (is_terminal(job->state)) schedule();
}

void Coordinator::fail_jobs_of(const std::string& agent, const std::string& reason) {
  for (JobRecord* job : jobs_.running_on(agent)) {
    jobs_.set_state(*job, job->stop_requested ? JobState::Cancelled : JobState::Failed, reason);
    spdlog::warn("job {} '{}' {}: {}", job->id, job->name, job_state_name(job->state), reason);
    publish(*job);
  }
}

void Coordinator::schedule() {
  for (JobRecord* job : jobs_.queued()) {
    AgentRecord* chosen = nullptr;
    for (auto& [name, agent] : agents_) {
      if (agent.job_id == 0 && device_fits(job->device, pool().backend)) {
        chosen = &agent;
        break;
      }
    }
    if (!chosen) return;  // no idle agent: later jobs wait too (priority order)
    chosen->job_id = job->id;
    job->agent = chosen->name;
    jobs_.set_state(*job, JobState::Running);
    flatbuffers::FlatBufferBuilder fbb(1024);
    auto spec = proto::JobSpec::Pack(fbb, job->spec.get());
    finish_envelope(fbb, {0, "coordinator", 0}, proto::Body::AssignJob,
                    proto::CreateAssignJob(fbb, job->id, spec).Union());
    push_to_agent(*chosen, fbb);
    spdlog::info("job {} '{}' assigned to agent '{}'", job->id, job->name, chosen->name);
    publish(*job);
  }
}

}  // namespace leasehold
