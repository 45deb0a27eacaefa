#include "tests/support/core_driver.h"

#include <stdexcept>

#include "coordinator/job_codec.h"
#include "shared/protocol.h"

namespace leasehold::testing {
namespace {

// A process of CoreDriver's bookkeeping (its `gone`, `unendable`, `killed`).
class FakeProcess final : public AgentProcess {
 public:
  FakeProcess(CoreDriver& d, int pid) : d_(d), pid_(pid) {}
  int pid() const override { return pid_; }
  bool gone() const override { return d_.gone.count(pid_) > 0; }
  bool stopped() const override { return !gone() && d_.stopped.count(pid_) > 0; }
  std::string end() override {
    if (d_.unendable.count(pid_)) return "another user's process";
    d_.killed.push_back(pid_);
    d_.gone.insert(pid_);
    return "";
  }

 private:
  CoreDriver& d_;
  const int pid_;
};

}  // namespace

CoreDriver::CoreDriver(CoreOptions options, uint64_t pool_bytes,
                       std::unique_ptr<SchedulingPolicy> policy)
    : CoreDriver(std::move(options), std::vector<uint64_t>{pool_bytes}, std::move(policy)) {}

CoreDriver::CoreDriver(CoreOptions options, std::vector<uint64_t> pools,
                       std::unique_ptr<SchedulingPolicy> policy)
    : opts_(std::move(options)) {
  // Far from the epoch, so "older than" arithmetic never underflows.
  now_.steady = Clock::time_point{} + std::chrono::hours(1000);
  now_.unix_ms = 1'700'000'000'000ull;
  now_.unix_us = now_.unix_ms * 1000;
  if (opts_.state_dir.empty()) opts_.state_dir = "/var/lib/leasehold-test";
  // The fake agents are uid 1000's, not the test's own user: let them in
  // (agent_group = "*"; the default is checked in access_test).
  opts_.access = AccessPolicy(AccessPolicy::kAnyone, "", "", AccessPolicy::kAnyone);
  opts_.follow_process = [this](const Peer& p) -> std::shared_ptr<AgentProcess> {
    return std::make_shared<FakeProcess>(*this, p.pid);
  };
  std::vector<PoolDescriptor> descriptors;
  for (size_t i = 0; i < pools.size(); ++i) {
    PoolDescriptor& pool = descriptors.emplace_back();
    pool.backend = Backend::Host;
    pool.device = static_cast<int>(i);
    pool.device_name = "test pool";
    pool.uuid = "host-" + std::to_string(i);
    pool.size = pools[i];
    pool.alignment = 1ull << 20;
    pool.epoch = 7 + i;
  }
  if (!policy) policy = std::make_unique<FifoPolicy>();
  core_ = std::make_unique<CoordinatorCore>(opts_, std::move(descriptors), std::move(policy), now_);
}

void CoreDriver::advance(std::chrono::milliseconds d) {
  now_.steady += d;
  now_.unix_ms += static_cast<uint64_t>(d.count());
  now_.unix_us = now_.unix_ms * 1000;
}

Effects CoreDriver::request(const std::string& rid, const std::string& sender, SessionToken session,
                            proto::Body type, const Build& build) {
  flatbuffers::FlatBufferBuilder fbb;
  auto body = build(fbb);
  finish_envelope(fbb, {next_request_++, sender, session}, type, body);
  // Decoded from an aligned copy, exactly as the broker does.
  std::vector<uint64_t> words((fbb.GetSize() + 7) / 8);
  std::memcpy(words.data(), fbb.GetBufferPointer(), fbb.GetSize());
  auto decoded =
      decode({reinterpret_cast<const uint8_t*>(words.data()), static_cast<size_t>(fbb.GetSize())});
  if (auto* err = std::get_if<DecodeError>(&decoded)) throw std::logic_error(err->message);
  Effects out;
  core_->handle(rid, *std::get<const proto::Envelope*>(decoded), now_, out, peer);
  return out;
}

Effects CoreDriver::tick() {
  Effects out;
  core_->tick(now_, out);
  return out;
}

namespace {

flatbuffers::Offset<flatbuffers::Vector<flatbuffers::Offset<proto::AgentJob>>> listed(
    flatbuffers::FlatBufferBuilder& fbb, const std::vector<Listed>& jobs) {
  std::vector<flatbuffers::Offset<proto::AgentJob>> v;
  for (const auto& j : jobs) {
    v.push_back(proto::CreateAgentJob(fbb, j.job_id, j.attempt, j.phase));
  }
  return fbb.CreateVector(v);
}

}  // namespace

FakeAgent CoreDriver::register_agent(const std::string& name, int pid,
                                     const std::vector<Listed>& jobs, Effects* out, bool takes_jobs,
                                     int device) {
  FakeAgent a{name, pid, "rid-" + name + "-" + std::to_string(pid), {}};
  // The same fake process (name and pid) keeps its instance, as a real
  // agent does across its own registrations.
  const uint64_t instance = std::hash<std::string>{}(name) | 1;
  // On ipc:// the kernel names the same process the agent declares.
  const Peer as_user = peer;
  if (peer.known) peer.pid = pid;
  Effects e = request(a.rid, name, {}, proto::Body::Register, [&](auto& fbb) {
    return proto::CreateRegister(fbb, fbb.CreateString(name), pid, device, listed(fbb, jobs),
                                 takes_jobs, true, 0, 0, instance, uint64_t(pid), stale_holds)
        .Union();
  });
  peer = as_user;
  auto acks = messages(e, proto::Body::RegisterAck, a.rid);
  if (acks.empty()) throw std::logic_error("no RegisterAck: " + errors(e));
  const auto* ack = acks[0]->body.AsRegisterAck();
  a.session = SessionToken{ack->session, ack->session_hi};
  if (out) *out = std::move(e);
  return a;
}

Effects CoreDriver::heartbeat(const FakeAgent& a, const std::vector<Listed>& jobs) {
  return request(a.rid, a.name, a.session, proto::Body::Heartbeat, [&](auto& fbb) {
    return proto::CreateHeartbeat(fbb, listed(fbb, jobs), true, 0, stale_holds).Union();
  });
}

proto::JobSpecT CoreDriver::small_job(const std::string& name) {
  proto::JobSpecT s;
  s.name = name;
  auto layer = [](proto::LayerType t, int in = 0, int out = 0) {
    auto l = std::make_unique<proto::LayerT>();
    l->type = t;
    l->in = in;
    l->out = out;
    return l;
  };
  s.model.push_back(layer(proto::LayerType::Flatten));
  s.model.push_back(layer(proto::LayerType::Linear, 64, 3));
  s.dataset = std::make_unique<proto::DatasetSpecT>();
  s.dataset->train_images = "/data/train-images";
  s.dataset->train_labels = "/data/train-labels";
  s.dataset->test_images = "/data/test-images";
  s.dataset->test_labels = "/data/test-labels";
  s.epochs = 5;
  s.memory_budget = "16MiB";
  return s;
}

Effects CoreDriver::submit(uint64_t& id, const std::function<void(proto::JobSpecT&)>& edit) {
  proto::JobSpecT spec = small_job("job" + std::to_string(next_request_));
  if (edit) edit(spec);
  Effects e = request("client", "client", {}, proto::Body::SubmitJob, [&](auto& fbb) {
    return proto::CreateSubmitJob(fbb, proto::JobSpec::Pack(fbb, &spec)).Union();
  });
  if (e.file_checks.size() != 1) throw std::logic_error("no file check: " + errors(e));
  Effects done;
  core_->file_check_done(e.file_checks[0].token, {}, now_, done);
  auto accepted = messages(done, proto::Body::JobAccepted, "client");
  if (accepted.empty()) throw std::logic_error("not accepted: " + errors(done));
  id = accepted[0]->body.AsJobAccepted()->job_id;
  return done;
}

Effects CoreDriver::update(const FakeAgent& a, uint64_t job, uint32_t attempt,
                           const std::string& state, const std::string& reason, int epoch,
                           bool checkpointed, int resumed_from) {
  return request(a.rid, a.name, a.session, proto::Body::JobUpdate, [&](auto& fbb) {
    proto::JobUpdateT u;
    u.job_id = job;
    u.attempt = attempt;
    u.status = parse_job_status(state).value_or(proto::JobStatus::Unset);
    u.reason = reason;
    u.resumed_from_epoch = resumed_from;
    if (epoch) {
      u.epoch = std::make_unique<proto::EpochStatT>();
      u.epoch->epoch = epoch;
      u.epoch->test_accuracy = 0.5 + epoch / 100.0;
      u.epoch->checkpointed = checkpointed;
    }
    return proto::JobUpdate::Pack(fbb, &u).Union();
  });
}

Effects CoreDriver::device_fault(const FakeAgent& a, uint64_t job, uint32_t attempt,
                                 const std::string& reason) {
  return request(a.rid, a.name, a.session, proto::Body::JobUpdate, [&](auto& fbb) {
    proto::JobUpdateT u;
    u.job_id = job;
    u.attempt = attempt;
    u.status = proto::JobStatus::Interrupted;
    u.reason = reason;
    u.device_fault = true;
    return proto::JobUpdate::Pack(fbb, &u).Union();
  });
}

Effects CoreDriver::first_step(const FakeAgent& a, uint64_t job, uint32_t attempt) {
  return request(a.rid, a.name, a.session, proto::Body::JobUpdate, [&](auto& fbb) {
    proto::JobUpdateT u;
    u.job_id = job;
    u.attempt = attempt;
    u.status = proto::JobStatus::Running;
    u.first_step_at_us = now_.unix_us ? now_.unix_us : now_.unix_ms * 1000 + 1;
    return proto::JobUpdate::Pack(fbb, &u).Union();
  });
}

Effects CoreDriver::cancel(uint64_t job) {
  return request("client", "client", {}, proto::Body::CancelJob,
                 [&](auto& fbb) { return proto::CreateCancelJob(fbb, job).Union(); });
}

Effects CoreDriver::lease(const FakeAgent& a, uint64_t bytes, int wait_ms, bool needed) {
  return request(a.rid, a.name, a.session, proto::Body::LeaseRequest, [&](auto& fbb) {
    return proto::CreateLeaseRequest(fbb, bytes, proto::LeaseEnd::Low, wait_ms, needed).Union();
  });
}

Effects CoreDriver::release(const FakeAgent& a, uint64_t lease_id) {
  return request(a.rid, a.name, a.session, proto::Body::LeaseRelease,
                 [&](auto& fbb) { return proto::CreateLeaseRelease(fbb, lease_id).Union(); });
}

Effects CoreDriver::shrink_done(const FakeAgent& a, uint64_t shrink_id, uint64_t released) {
  return request(a.rid, a.name, a.session, proto::Body::ShrinkDone, [&](auto& fbb) {
    return proto::CreateShrinkDone(fbb, shrink_id, released).Union();
  });
}

Effects CoreDriver::status() {
  return request("client", "client", {}, proto::Body::StatusRequest,
                 [](auto& fbb) { return proto::CreateStatusRequest(fbb).Union(); });
}

proto::StatusReplyT CoreDriver::status_reply() {
  Effects e = status();
  auto m = messages(e, proto::Body::StatusReply, "client");
  if (m.size() != 1) throw std::logic_error("no StatusReply: " + errors(e));
  return *m[0]->body.AsStatusReply();
}

Effects CoreDriver::attach(const FakeAgent& a, const std::string& name, uint64_t bytes, bool create,
                           int wait_ms, bool replace) {
  return request(a.rid, a.name, a.session, proto::Body::AttachRegion, [&](auto& fbb) {
    return proto::CreateAttachRegion(fbb, fbb.CreateString(name), bytes, create, replace, wait_ms)
        .Union();
  });
}

Effects CoreDriver::region_ready(const FakeAgent& a, const std::string& name) {
  return request(a.rid, a.name, a.session, proto::Body::RegionReady, [&](auto& fbb) {
    return proto::CreateRegionReady(fbb, fbb.CreateString(name)).Union();
  });
}

Effects CoreDriver::detach(const FakeAgent& a, const std::string& name) {
  return request(a.rid, a.name, a.session, proto::Body::DetachRegion, [&](auto& fbb) {
    return proto::CreateDetachRegion(fbb, fbb.CreateString(name)).Union();
  });
}

Effects CoreDriver::drop_region(const std::string& name) {
  return request("client", "client", {}, proto::Body::DropRegion, [&](auto& fbb) {
    return proto::CreateDropRegion(fbb, fbb.CreateString(name)).Union();
  });
}

proto::RegionListT CoreDriver::regions() {
  Effects e = request("client", "client", {}, proto::Body::ListRegions,
                      [](auto& fbb) { return proto::CreateListRegions(fbb).Union(); });
  auto m = messages(e, proto::Body::RegionList, "client");
  if (m.size() != 1) throw std::logic_error("no RegionList: " + errors(e));
  proto::RegionListT copy;
  const auto* list = m[0]->body.AsRegionList();
  for (const auto& r : list->regions) copy.regions.push_back(std::make_unique<proto::RegionT>(*r));
  copy.hits = list->hits;
  copy.misses = list->misses;
  copy.evictions = list->evictions;
  return copy;
}

const proto::RegionGrantT* region_grant(const Effects& e, const FakeAgent& a) {
  auto m = messages(e, proto::Body::RegionGrant, a.rid);
  return m.empty() ? nullptr : m[0]->body.AsRegionGrant();
}

std::optional<ErrorCode> error_code(const Effects& e, const std::string& rid) {
  auto m = messages(e, proto::Body::Error, rid);
  if (m.empty()) return std::nullopt;
  return m[0]->body.AsError()->code;
}

uint64_t granted_lease(const Effects& e, const FakeAgent& a) {
  auto m = messages(e, proto::Body::LeaseGrant, a.rid);
  return m.empty() ? 0 : m[0]->body.AsLeaseGrant()->lease->id;
}

const proto::ShrinkT* shrink_of(const Effects& e, const FakeAgent& a) {
  auto m = messages(e, proto::Body::Shrink, a.rid);
  return m.empty() ? nullptr : m[0]->body.AsShrink();
}

CoreOptions job_options() {
  CoreOptions o;
  o.heartbeat_interval = std::chrono::milliseconds(1000);
  o.first_heartbeat_grace = std::chrono::milliseconds(10000);
  o.recovery_grace = std::chrono::milliseconds(5000);
  return o;
}

std::vector<JobRecord> stored_rows(CoreDriver& d) {
  std::vector<JobRecord> rows;
  for (const auto& [id, job] : d.core().jobs().all())
    rows.push_back(decode_job(id, encode_job(job)));
  return rows;
}

std::vector<std::pair<uint64_t, uint32_t>> assigned(const Effects& e, const FakeAgent& a) {
  std::vector<std::pair<uint64_t, uint32_t>> out;
  for (const auto* m : messages(e, proto::Body::AssignJob, a.rid)) {
    out.emplace_back(m->body.AsAssignJob()->job_id, m->body.AsAssignJob()->attempt);
  }
  return out;
}

const proto::StopJobT* stop_of(const Effects& e, const FakeAgent& a, uint64_t job) {
  for (const auto* m : messages(e, proto::Body::StopJob, a.rid)) {
    if (m->body.AsStopJob()->job_id == job) return m->body.AsStopJob();
  }
  return nullptr;
}

std::vector<std::string> states(const JobRecord& j) {
  std::vector<std::string> s;
  for (const auto& h : j.history) s.push_back(job_status_name(h.status));
  return s;
}

std::vector<const OutMessage*> messages(const Effects& e, proto::Body type,
                                        const std::string& rid) {
  std::vector<const OutMessage*> out;
  for (const auto& m : e.messages) {
    if (m.body.type == type && (rid.empty() || m.to == rid)) out.push_back(&m);
  }
  return out;
}

std::string errors(const Effects& e) {
  std::string s;
  for (const auto* m : messages(e, proto::Body::Error)) {
    s += (s.empty() ? "" : " | ") + m->body.AsError()->message;
  }
  return s;
}

}  // namespace leasehold::testing
