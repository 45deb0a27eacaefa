#include "coordinator/job_codec.h"

#include <cstring>
#include <stdexcept>

#include "shared/protocol.h"

namespace leasehold {
namespace {

template <class T>
std::vector<T> tail(const std::vector<T>& v, size_t n) {
  return v.size() <= n ? v : std::vector<T>(v.end() - static_cast<std::ptrdiff_t>(n), v.end());
}

constexpr InfoDetail kEverything{true, SIZE_MAX, SIZE_MAX, SIZE_MAX, true};

}  // namespace

std::unique_ptr<proto::JobInfoT> job_info(const JobRecord& job, const InfoDetail& detail) {
  auto info = std::make_unique<proto::JobInfoT>();
  info->id = job.id;
  info->name = job.name;
  info->status = job_status(job.state);
  info->agent = job.agent;
  info->priority = job.priority;
  info->submitted_ms = job.submitted_ms;
  for (const auto& h : tail(job.history, detail.max_history)) {
    info->history.push_back(std::make_unique<proto::StateChangeT>(h));
  }
  info->history_total = static_cast<uint32_t>(job.history.size()) + job.history_dropped;
  info->progress = std::make_unique<proto::ProgressT>(job.progress);
  for (const auto& e : tail(job.epochs, detail.max_epochs)) {
    info->epochs.push_back(std::make_unique<proto::EpochStatT>(e));
  }
  info->epochs_total = static_cast<uint32_t>(job.epochs.size()) + job.epochs_dropped;
  info->test_accuracy = job.test_accuracy;
  info->samples_per_second = job.samples_per_second;
  info->reason = job.reason;
  if (detail.spec && job.spec) {
    info->spec = std::make_unique<proto::JobSpecT>(*job.spec);
    if (info->spec->program && !detail.environment_values) {
      for (auto& var : info->spec->program->environment) var->value = kHiddenValue;
    }
  }
  for (const auto& a : tail(job.attempts, detail.max_attempts)) {
    auto t = std::make_unique<proto::AttemptT>();
    t->number = a.number;
    t->agent = a.agent;
    t->started_ms = a.started_ms;
    t->ended_ms = a.ended_ms;
    t->outcome = a.outcome;
    t->reason = a.reason;
    t->resumed_from_epoch = a.resumed_from_epoch;
    t->agent_identity = a.agent_identity;
    t->cause = a.cause;
    t->replica_agents = a.replica_agents;
    info->attempts.push_back(std::move(t));
  }
  info->max_attempts = job.max_attempts;
  info->agent_failures = job.agent_failures;
  info->resumed_from_epoch = job.attempts.empty() ? 0 : job.attempts.back().resumed_from_epoch;
  info->checkpoint = job.checkpoint;
  info->cancel_requested = job.cancel_requested;
  info->finished_ms = job.finished_ms;
  info->memory_wait_ms = job.memory_wait_ms;
  info->shrinks = job.shrinks;
  info->shrunk_bytes = job.shrunk_bytes;
  info->waiting_for = job.waiting_for;
  info->assigned_at_us = job.assigned_at_us;
  info->first_step_at_us = job.first_step_at_us;
  info->submitted_by = job.submitted_by;
  info->submitted_uid = job.submitted_uid ? int64_t(*job.submitted_uid) : -1;
  info->exit_code = job.exit_code;
  // What its plug-in reported, once it did.
  if (job.is_program() && job.program_memory.allocations > 0) {
    info->program_memory = std::make_unique<proto::ProgramMemoryT>(job.program_memory);
  }
  info->log_bytes = job.log_bytes;
  for (const auto& [cause, count] : job.interruptions) {
    auto c = std::make_unique<proto::InterruptionCountT>();
    c->cause = cause;
    c->count = count;
    info->interruptions.push_back(std::move(c));
  }
  info->cancelled_by = job.cancelled_by;
  return info;
}

std::vector<uint8_t> encode_job(const JobRecord& job) {
  flatbuffers::FlatBufferBuilder fbb(1024);
  auto info = job_info(job, kEverything);
  info->submit_key = job.submit_key;  // stored only, never sent
  info->log_tail = job.log;
  info->program_token_lo = job.program_token.lo;
  info->program_token_hi = job.program_token.hi;
  info->attempt_log_bytes = job.attempt_log_bytes;
  fbb.Finish(proto::JobInfo::Pack(fbb, info.get()));
  return {fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize()};
}

JobRecord decode_job(uint64_t id, std::span<const uint8_t> bytes) {
  auto bad = [&](const std::string& why) {
    return std::runtime_error("stored job " + std::to_string(id) + " is unreadable: " + why);
  };
  // FlatBuffers reads fields in place: copy to an aligned buffer first.
  std::vector<uint64_t> aligned((bytes.size() + 7) / 8);
  if (!bytes.empty()) std::memcpy(aligned.data(), bytes.data(), bytes.size());
  const auto* data = reinterpret_cast<const uint8_t*>(aligned.data());
  flatbuffers::Verifier v(data, bytes.size());
  if (!v.VerifyBuffer<proto::JobInfo>(nullptr)) throw bad("it fails FlatBuffers verification");
  std::unique_ptr<proto::JobInfoT> info(flatbuffers::GetRoot<proto::JobInfo>(data)->UnPack());
  if (info->id != id) throw bad("it holds job " + std::to_string(info->id));
  // Its state, or for a job stored before protocol version 6 its state's
  // text (and its history's: made statuses here, so that they go out so).
  auto state = info->status != proto::JobStatus::Unset ? job_state_of(info->status)
                                                       : parse_job_state(info->state);
  if (!state) {
    throw bad("unknown state '" +
              (info->status != proto::JobStatus::Unset ? job_status_name(info->status)
                                                       : info->state) +
              "'");
  }
  for (auto& h : info->history) {
    if (!h || h->status != proto::JobStatus::Unset) continue;
    if (auto old = parse_job_state(h->state)) h->status = job_status(*old);
    h->state.clear();
  }
  if (!info->spec) throw bad("it has no job specification");

  JobRecord job;
  job.id = info->id;
  job.name = info->name;
  job.priority = info->priority;
  job.device = info->spec->device.empty() ? "auto" : info->spec->device;
  job.spec = std::shared_ptr<const proto::JobSpecT>(std::move(info->spec));
  job.state = *state;
  job.agent = info->agent;
  job.reason = info->reason;
  job.submitted_ms = info->submitted_ms;
  job.finished_ms = info->finished_ms;
  for (auto& h : info->history) job.history.push_back(*h);
  if (info->progress) job.progress = *info->progress;
  for (auto& e : info->epochs) job.epochs.push_back(*e);
  job.epochs_dropped = info->epochs_total > job.epochs.size()
                           ? info->epochs_total - static_cast<uint32_t>(job.epochs.size())
                           : 0;
  job.history_dropped = info->history_total > job.history.size()
                            ? info->history_total - static_cast<uint32_t>(job.history.size())
                            : 0;
  job.test_accuracy = info->test_accuracy;
  job.samples_per_second = info->samples_per_second;
  job.cancel_requested = info->cancel_requested;
  for (auto& a : info->attempts) {
    job.attempts.push_back(AttemptRecord{a->number, a->agent, a->started_ms, a->ended_ms,
                                         a->outcome, a->reason, a->resumed_from_epoch,
                                         a->agent_identity, a->cause, a->replica_agents});
  }
  for (auto& c : info->interruptions) {
    if (c) job.interruptions[c->cause] += c->count;
  }
  job.cancelled_by = info->cancelled_by;
  job.agent_failures = info->agent_failures;
  job.max_attempts = info->max_attempts;
  job.checkpoint = info->checkpoint;
  job.memory_wait_ms = info->memory_wait_ms;
  job.shrinks = info->shrinks;
  job.shrunk_bytes = info->shrunk_bytes;
  job.assigned_at_us = info->assigned_at_us;
  job.first_step_at_us = info->first_step_at_us;
  job.submitted_by = info->submitted_by;
  job.submit_key = info->submit_key;
  job.exit_code = info->exit_code;
  if (info->program_memory) job.program_memory = *info->program_memory;
  job.log = std::move(info->log_tail);
  job.program_token = SessionToken{info->program_token_lo, info->program_token_hi};
  job.attempt_log_bytes = info->attempt_log_bytes;
  job.log_bytes = std::max<uint64_t>(info->log_bytes, job.log.size());
  if (info->submitted_uid >= 0 && info->submitted_uid <= int64_t(UINT32_MAX)) {
    job.submitted_uid = static_cast<uint32_t>(info->submitted_uid);
  }
  return job;
}

}  // namespace leasehold
