// Drives a CoordinatorCore without sockets or processes: builds requests as
// agents and clients would send them, hands them to the core with a fake
// clock, and looks into what came out.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "coordinator/core.h"

namespace leasehold::testing {

// An agent as the core sees it: its name, pid, socket and session token.
struct FakeAgent {
  std::string name;
  int pid = 0;
  std::string rid;
  SessionToken session;
};

// A job an agent lists in its Register or Heartbeat.
struct Listed {
  uint64_t job_id;
  uint32_t attempt;
  proto::JobPhase phase;
};

class CoreDriver {
 public:
  // `policy`: null for FifoPolicy.
  explicit CoreDriver(CoreOptions options = {}, uint64_t pool_bytes = 64ull << 20,
                      std::unique_ptr<SchedulingPolicy> policy = nullptr);
  // A device per entry of `pools` (ordinals 0, 1, ...), of that many bytes.
  CoreDriver(CoreOptions options, std::vector<uint64_t> pools,
             std::unique_ptr<SchedulingPolicy> policy = nullptr);

  CoordinatorCore& core() { return *core_; }
  Now now() const { return now_; }
  void advance(std::chrono::milliseconds d);
  // The agents' processes, as the core follows them (follow_process): pids
  // in `gone` have exited; a SIGKILL the core sends is recorded in `killed`
  // (the process then exits: its pid joins `gone`) unless the pid is in
  // `unendable` (another user's process). Pids in `stopped` are stopped
  // (SIGSTOP): their silence is fenced after two heartbeats.
  std::set<int> gone, unendable, stopped;
  std::vector<int> killed;
  // What agents report in every Register and Heartbeat as still held from
  // an earlier session.
  uint32_t stale_holds = 0;
  // Who every request comes from (a local user, as on an ipc:// socket).
  Peer peer = Peer::local(1000, 1000, 4242);

  // Sends `body_type`/`build` from `sender` on socket `rid`.
  using Build = std::function<flatbuffers::Offset<void>(flatbuffers::FlatBufferBuilder&)>;
  Effects request(const std::string& rid, const std::string& sender, SessionToken session,
                  proto::Body type, const Build& build);
  Effects tick();

  // Registers (expects a RegisterAck) and returns the agent; a standby
  // worker unless `takes_jobs` is false; on `device` (-1: the core picks).
  FakeAgent register_agent(const std::string& name, int pid, const std::vector<Listed>& jobs = {},
                           Effects* out = nullptr, bool takes_jobs = true, int device = -1);
  Effects heartbeat(const FakeAgent& a, const std::vector<Listed>& jobs = {});
  // Submits a small valid job; the file check passes at once. Returns the
  // effects of the check (with the JobAccepted reply) and sets `id`.
  Effects submit(uint64_t& id, const std::function<void(proto::JobSpecT&)>& edit = {});
  Effects update(const FakeAgent& a, uint64_t job, uint32_t attempt, const std::string& state,
                 const std::string& reason = "", int epoch = 0, bool checkpointed = false,
                 int resumed_from = 0);
  // The agent's final report of a job interrupted by a lost GPU context.
  Effects device_fault(const FakeAgent& a, uint64_t job, uint32_t attempt,
                       const std::string& reason = "");
  // The attempt's first step began (JobUpdate.first_step_at_us).
  Effects first_step(const FakeAgent& a, uint64_t job, uint32_t attempt);
  Effects cancel(uint64_t job);
  // `needed`: LeaseRequest.needed (growth its job cannot do without).
  Effects lease(const FakeAgent& a, uint64_t bytes, int wait_ms, bool needed = false);
  Effects release(const FakeAgent& a, uint64_t lease_id);
  Effects shrink_done(const FakeAgent& a, uint64_t shrink_id, uint64_t released);
  Effects status();
  // The StatusReply a client gets now.
  proto::StatusReplyT status_reply();
  // Shared cache regions.
  Effects attach(const FakeAgent& a, const std::string& name, uint64_t bytes, bool create,
                 int wait_ms = -1, bool replace = false);
  Effects region_ready(const FakeAgent& a, const std::string& name);
  Effects detach(const FakeAgent& a, const std::string& name);
  Effects drop_region(const std::string& name);
  // The regions as `leasehold regions` gets them.
  proto::RegionListT regions();

  const JobRecord& job(uint64_t id) { return *core_->jobs().find(id); }

  // A job spec that passes validation without touching files.
  static proto::JobSpecT small_job(const std::string& name);

 private:
  CoreOptions opts_;
  Now now_;
  std::unique_ptr<CoordinatorCore> core_;
  uint64_t next_request_ = 1;
};

// Options of the job tests: 1 s heartbeats, 10 s first-heartbeat grace, 5 s
// recovery grace.
CoreOptions job_options();
// The AssignJob pushes in `e` for agent `a`: (job id, attempt).
std::vector<std::pair<uint64_t, uint32_t>> assigned(const Effects& e, const FakeAgent& a);
// `d`'s jobs as the store would give them back after a crash (through
// their stored form), for CoordinatorCore::recover.
std::vector<JobRecord> stored_rows(CoreDriver& d);
// The StopJob pushed in `e` to `a` for `job`, if any.
const proto::StopJobT* stop_of(const Effects& e, const FakeAgent& a, uint64_t job);
inline bool stops(const Effects& e, const FakeAgent& a, uint64_t job) {
  return stop_of(e, a, job) != nullptr;
}
// The states in a job's history, in order.
std::vector<std::string> states(const JobRecord& j);

// The messages in `e` whose body is `type`, optionally only those sent to
// `rid`. The pointers point into `e`: keep it alive while using them.
std::vector<const OutMessage*> messages(const Effects& e, proto::Body type,
                                        const std::string& rid = "");
// The error replies' messages, joined.
std::string errors(const Effects& e);
// The lease granted to `a` in `e` (0: none).
uint64_t granted_lease(const Effects& e, const FakeAgent& a);
// The RegionGrant sent to `a` in `e`, if any.
const proto::RegionGrantT* region_grant(const Effects& e, const FakeAgent& a);
// The error code of the reply to `rid` in `e`, if it is an Error.
std::optional<ErrorCode> error_code(const Effects& e, const std::string& rid);
// The Shrink pushed to `a` in `e`, if any.
const proto::ShrinkT* shrink_of(const Effects& e, const FakeAgent& a);

}  // namespace leasehold::testing
