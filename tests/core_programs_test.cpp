// Program jobs in the core (coordinator/core_programs.cpp): who may submit
// one, the session its process registers (bound to the attempt by a token,
// its leases the job's and capped at the job's budget), and its output kept
// as the job's log.
#include <gtest/gtest.h>

#include "coordinator/access.h"
#include "coordinator/job_codec.h"
#include "coordinator/metrics.h"
#include "shared/protocol.h"
#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
using P = proto::JobPhase;

void make_program(proto::JobSpecT& s) {
  s.model.clear();
  s.dataset.reset();
  s.epochs = 0;
  s.program = std::make_unique<proto::ProgramSpecT>();
  s.program->command = {"python3", "train.py"};
  s.program->directory = "/tmp";
  s.memory_budget = "8MiB";
}

struct Program {
  uint64_t job = 0;
  SessionToken token;
  FakeAgent agent;
};

// A program job running on agent "a" (pid 11), and the token its AssignJob
// carried.
Program start_program(CoreDriver& d) {
  Program p;
  p.agent = d.register_agent("a", 11);
  Effects accepted = d.submit(p.job, make_program);
  for (const auto* m : messages(accepted, proto::Body::AssignJob, p.agent.rid)) {
    const auto* a = m->body.AsAssignJob();
    p.token = SessionToken{a->job_token_lo, a->job_token_hi};
  }
  d.heartbeat(p.agent, {{p.job, 1, P::Running}});
  return p;
}

// Registers the program's session as "a:jobN" (pid 21) with `token`.
Effects register_session(CoreDriver& d, const Program& p, SessionToken token,
                         const std::string& name = "", uint32_t attempt = 1) {
  const std::string n = name.empty() ? "a:job" + std::to_string(p.job) : name;
  const Peer as_user = d.peer;
  d.peer.pid = 21;
  Effects e = d.request("rid-" + n, n, {}, proto::Body::Register, [&](auto& fbb) {
    return proto::CreateRegister(fbb, fbb.CreateString(n), 21, -1, 0, false, true, 0, 0, 5, 6, 0,
                                 p.job, attempt, token.lo, token.hi)
        .Union();
  });
  d.peer = as_user;
  return e;
}

FakeAgent session_of(const Effects& e, const std::string& name, const std::string& rid) {
  auto acks = messages(e, proto::Body::RegisterAck, rid);
  if (acks.empty()) throw std::logic_error("no RegisterAck: " + errors(e));
  const auto* ack = acks[0]->body.AsRegisterAck();
  return FakeAgent{name, 21, rid, SessionToken{ack->session, ack->session_hi}};
}

TEST(CorePrograms, OnlyTheCoordinatorsUserSubmitsProgramsUnlessProgramGroupOpensThem) {
  const Peer alice = Peer::local(4242, 4242, 99);
  AccessPolicy closed(AccessPolicy::kAnyone, "", "", "");
  auto no = closed.check(Role::Program, alice);
  ASSERT_TRUE(no);
  EXPECT_NE(no->find("program_group is not set"), std::string::npos) << *no;
  EXPECT_FALSE(closed.check(Role::Program, Peer::local(0, 0, 1))) << "root may";
  EXPECT_FALSE(closed.check(Role::Client, alice)) << "engine jobs stay open";
  AccessPolicy open(AccessPolicy::kAnyone, "", "", AccessPolicy::kAnyone);
  EXPECT_FALSE(open.check(Role::Program, alice));
  auto net = open.check(Role::Program, Peer::with_key("bob"));
  ASSERT_TRUE(net) << "a network client's folder and user cannot be checked";
  EXPECT_NE(net->find("local socket"), std::string::npos) << *net;
}

TEST(CorePrograms, AProgramsSessionIsBoundToItsAttemptByTheToken) {
  CoreDriver d(job_options());
  Program p = start_program(d);
  ASSERT_FALSE(p.token.empty()) << "the assignment carries the attempt's token";
  const std::string name = "a:job" + std::to_string(p.job);
  // Wrong token, attempt, name, user: refused, naming what is wrong.
  SessionToken wrong = p.token;
  wrong.lo ^= 1;
  EXPECT_NE(errors(register_session(d, p, wrong)).find("token"), std::string::npos);
  EXPECT_NE(errors(register_session(d, p, p.token, "", 2)).find("attempt 2 is not running"),
            std::string::npos);
  EXPECT_NE(errors(register_session(d, p, p.token, "b:job1")).find("must be named"),
            std::string::npos);
  d.peer = Peer::local(2000, 2000, 77);
  EXPECT_NE(errors(register_session(d, p, p.token)).find("must run as its agent does"),
            std::string::npos);
  d.peer = Peer::local(1000, 1000, 4242);
  EXPECT_FALSE(d.core().agents().count(name));
  Effects ok = register_session(d, p, p.token);
  FakeAgent session = session_of(ok, name, "rid-" + name);
  const auto st = d.core().status(d.now());
  std::map<std::string, std::pair<std::string, uint64_t>> agents;
  for (const auto& a : st.agents) agents[a->name] = {agent_state_name(a->state), a->job_id};
  EXPECT_EQ(agents[name], (std::pair<std::string, uint64_t>{"program", p.job}));
  EXPECT_EQ(agents["a"].second, p.job);
  // It takes no job itself.
  uint64_t other = 0;
  d.submit(other);
  d.heartbeat(session);
  EXPECT_EQ(d.job(other).state, JobState::Queued);
  // The next attempt's token is another.
  d.update(p.agent, p.job, 1, "interrupted", "the agent stops");
  EXPECT_NE(errors(register_session(d, p, p.token, name + "x")).size(), 0u);
}

TEST(CorePrograms, AProgramsLeasesAreCappedAtItsJobsBudget) {
  CoreDriver d(job_options(), 64ull << 20);
  Program p = start_program(d);  // memory_budget 8 MiB
  const std::string name = "a:job" + std::to_string(p.job);
  FakeAgent session = session_of(register_session(d, p, p.token), name, "rid-" + name);
  d.heartbeat(session);
  EXPECT_NE(granted_lease(d.lease(session, 6 << 20, 0), session), 0u);
  Effects over = d.lease(session, 3 << 20, 0);
  EXPECT_EQ(error_code(over, session.rid), ErrorCode::NoSpace);
  EXPECT_NE(errors(over).find("memory_budget of 8.00 MiB would be exceeded: 6.00 MiB leased"),
            std::string::npos)
      << errors(over);
  EXPECT_NE(granted_lease(d.lease(session, 2 << 20, 0), session), 0u) << "up to the budget";
  // The policy sees the job's memory as its session's, not its agent's.
  const PoolView view = d.core().pool_view(d.core().device(0));
  for (const auto& a : view.agents) {
    if (a.name == name) {
      EXPECT_EQ(a.job_id, p.job);
      EXPECT_EQ(a.leased, 8u << 20);
    } else if (a.name == "a") {
      EXPECT_EQ(a.job_id, 0u) << "no reservation counted twice";
    }
  }
}

TEST(CorePrograms, OutputBecomesTheJobsLogBoundedAndOnlyItsOwnerReadsIt) {
  CoreDriver d(job_options());
  Program p = start_program(d);
  auto update = [&](const std::string& chunk, uint64_t offset) {
    return d.request(p.agent.rid, p.agent.name, p.agent.session, proto::Body::JobUpdate,
                     [&](auto& fbb) {
                       proto::JobUpdateT u;
                       u.job_id = p.job;
                       u.attempt = 1;
                       u.status = proto::JobStatus::Running;
                       u.log = chunk;
                       u.log_offset = offset;
                       return proto::JobUpdate::Pack(fbb, &u).Union();
                     });
  };
  auto read_log = [&](uint64_t offset) {
    Effects e = d.request("cli", "cli", {}, proto::Body::GetJobLog, [&](auto& fbb) {
      return proto::CreateGetJobLog(fbb, p.job, offset, 0).Union();
    });
    auto m = messages(e, proto::Body::JobLog, "cli");
    if (m.empty()) throw std::logic_error(errors(e));
    return *m[0]->body.AsJobLog();
  };
  update("hello ", 0);
  update("hello world\n", 0);  // sent again with more: only the new part
  update("step 1\n", 12);
  auto log = read_log(0);
  EXPECT_EQ(log.data, "hello world\nstep 1\n");
  EXPECT_EQ(log.total, 19u);
  EXPECT_FALSE(log.finished);
  update("x\n", 40);  // 21 bytes never arrived
  EXPECT_NE(read_log(19).data.find("21 bytes of output were lost"), std::string::npos);
  // Bounded: the oldest bytes go.
  const std::string big(kJobLogChunkBytes, 'y');
  uint64_t offset = 42;
  for (int i = 0; i < 20; ++i, offset += big.size()) update(big, offset);
  log = read_log(0);
  EXPECT_GT(log.first_kept, 0u);
  EXPECT_EQ(log.total - log.first_kept, kJobLogBytes);
  EXPECT_EQ(log.offset, log.first_kept) << "asked from 0, answered from the oldest kept";
  EXPECT_LE(log.data.size(), kJobLogReplyBytes);
  // Another user may not read it.
  d.peer = Peer::local(3000, 3000, 5);
  Effects theirs = d.request("cli", "cli", {}, proto::Body::GetJobLog, [&](auto& fbb) {
    return proto::CreateGetJobLog(fbb, p.job, 0, 0).Union();
  });
  EXPECT_EQ(error_code(theirs, "cli"), ErrorCode::PermissionDenied);
  d.peer = Peer::local(1000, 1000, 4242);
  // The final report carries the exit status.
  Effects end =
      d.request(p.agent.rid, p.agent.name, p.agent.session, proto::Body::JobUpdate, [&](auto& fbb) {
        proto::JobUpdateT u;
        u.job_id = p.job;
        u.attempt = 1;
        u.status = proto::JobStatus::Failed;
        u.reason = "exit status 3";
        u.exit_code = 3;
        return proto::JobUpdate::Pack(fbb, &u).Union();
      });
  EXPECT_EQ(d.job(p.job).exit_code, 3);
  EXPECT_TRUE(read_log(0).finished);
}

TEST(CorePrograms, APluginsFiguresAndItsSessionsLeasesAreTheJobsInMetrics) {
  CoreDriver d(job_options(), 64ull << 20);
  Program p = start_program(d);
  const std::string name = "a:job" + std::to_string(p.job);
  FakeAgent session = session_of(register_session(d, p, p.token), name, "rid-" + name);
  d.heartbeat(session);
  ASSERT_NE(granted_lease(d.lease(session, 6 << 20, 0), session), 0u);
  // The agent forwards what the program's plug-in reported.
  Effects e =
      d.request(p.agent.rid, p.agent.name, p.agent.session, proto::Body::JobUpdate, [&](auto& fbb) {
        proto::JobUpdateT u;
        u.job_id = p.job;
        u.attempt = 1;
        u.status = proto::JobStatus::Running;
        u.memory = std::make_unique<proto::ProgramMemoryT>();
        u.memory->leased_bytes = 6 << 20;
        u.memory->in_use_bytes = 5 << 20;
        u.memory->allocations = 1200;
        u.memory->cache_hits = 1197;
        u.memory->lease_requests = 3;
        u.memory->outside_pool_bytes = 500 << 20;
        return proto::JobUpdate::Pack(fbb, &u).Union();
      });
  ASSERT_EQ(errors(e), "");
  const std::string text =
      render_metrics(take_metrics_snapshot(d.core(), d.core().status(d.now())));
  const std::string job = "job_id=\"" + std::to_string(p.job) + "\"";
  auto series = [&](const std::string& family) {
    for (size_t at = text.find(family + "{"); at != std::string::npos;
         at = text.find(family + "{", at + 1)) {
      const std::string line = text.substr(at, text.find('\n', at) - at);
      if (line.find(job) != std::string::npos) return line.substr(line.rfind(' ') + 1);
    }
    return std::string("(none)");
  };
  EXPECT_EQ(series("leasehold_job_leased_bytes"), "6291456") << "its session's leases";
  EXPECT_EQ(series("leasehold_job_program_in_use_bytes"), "5242880");
  EXPECT_EQ(series("leasehold_job_program_allocations_total"), "1200");
  EXPECT_EQ(series("leasehold_job_program_cache_hits_total"), "1197");
  EXPECT_EQ(series("leasehold_job_program_lease_requests_total"), "3");
  EXPECT_EQ(series("leasehold_job_program_outside_pool_bytes"), "524288000");
}

TEST(CorePrograms, AProgramsSessionEndsWithItsAttempt) {
  CoreDriver d(job_options(), 64ull << 20);
  Program p = start_program(d);
  const std::string name = "a:job" + std::to_string(p.job);
  FakeAgent session = session_of(register_session(d, p, p.token), name, "rid-" + name);
  d.heartbeat(session);
  ASSERT_NE(granted_lease(d.lease(session, 4 << 20, 0), session), 0u);
  // The attempt ends (here: its agent says it was interrupted) while the
  // program's process may live on: its session goes, its leases fenced, and
  // it leases nothing more for the job.
  d.update(p.agent, p.job, 1, "interrupted", "the agent is shutting down");
  Effects more = d.lease(session, 2 << 20, 0);
  EXPECT_NE(errors(more), "") << "a session of an ended attempt leased more";
  for (const auto& a : d.core().pool_view(d.core().device(0)).agents) EXPECT_NE(a.name, name);
  const proto::StatusReplyT st = d.core().status(d.now());
  bool fenced = false;
  for (const auto& f : st.fences) fenced = fenced || f->agent == name;
  EXPECT_TRUE(fenced) << "its leases went back while its process may still write";
}

// The holder of lease `id` as status shows it (`found`: whether it does).
proto::LeaseHolder holder_of(CoreDriver& d, uint64_t id, bool* found) {
  *found = false;
  for (const auto& l : d.core().status(d.now()).leases) {
    if (l->id == id) {
      *found = true;
      return l->holder;
    }
  }
  return proto::LeaseHolder::Agent;
}

// A program job's process runs somebody else's code, which may keep the
// memory of a lease it gave back (a map of its own); the next holder's
// tensors would be in its reach. So what its session gives back, released
// or reclaimed, goes to nobody before the chunks have new memory.
TEST(CorePrograms, MemoryAProgramsSessionGaveBackGoesToNobodyBeforeItsChunksAreRenewed) {
  CoreDriver d(job_options(), 16ull << 20);
  Program p = start_program(d);  // memory_budget 8 MiB
  const std::string name = "a:job" + std::to_string(p.job);
  FakeAgent session = session_of(register_session(d, p, p.token), name, "rid-" + name);
  d.heartbeat(session);
  FakeAgent other = d.register_agent("b", 12);
  const uint64_t l1 = granted_lease(d.lease(session, 4 << 20, 0), session);
  const uint64_t l2 = granted_lease(d.lease(session, 4 << 20, 0), session);
  ASSERT_NE(l1, 0u);
  ASSERT_NE(l2, 0u);
  EXPECT_TRUE(d.core().take_chunk_renewals().empty());

  // It cannot hand memory back by shrinking a lease (that bypasses renewal).
  Effects shrink = d.request(session.rid, session.name, session.session, proto::Body::LeaseResize,
                             [&](auto& fbb) { return proto::CreateLeaseResize(fbb, l1, 2 << 20).Union(); });
  EXPECT_EQ(error_code(shrink, session.rid), ErrorCode::InvalidArgument);
  EXPECT_NE(errors(shrink).find("release it instead"), std::string::npos) << errors(shrink);

  // Released: held as renewing, its chunks queued for new memory.
  d.release(session, l1);
  bool found = false;
  EXPECT_EQ(holder_of(d, l1, &found), proto::LeaseHolder::Renewing);
  EXPECT_TRUE(found);
  std::vector<ChunkRenewal> r = d.core().take_chunk_renewals();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].lease_id, l1);
  EXPECT_EQ(r[0].count * d.core().device(0).pool.alignment, 4u << 20);
  // Nobody else gets that memory meanwhile: the whole pool is not free.
  Effects all = d.lease(other, 16 << 20, 0);
  EXPECT_EQ(error_code(all, other.rid), ErrorCode::NoSpace) << errors(all);
  // A renewal that failed keeps the chunks out of service.
  Effects none;
  d.core().chunks_renewed(0, l1, "cuMemCreate: out of memory", none);
  EXPECT_EQ(holder_of(d, l1, &found), proto::LeaseHolder::Renewing);
  // Another session's release, or an engine agent's, is free at once.
  const uint64_t mine = granted_lease(d.lease(other, 2 << 20, 0), other);
  d.release(other, mine);
  EXPECT_TRUE(d.core().take_chunk_renewals().empty());

  // The attempt ends while its process may live on: l2 is fenced; once the
  // process exited it is renewed rather than freed.
  d.update(p.agent, p.job, 1, "interrupted", "the agent is shutting down");
  EXPECT_TRUE(d.core().take_chunk_renewals().empty()) << "fenced first";
  d.gone.insert(21);
  d.tick();
  EXPECT_EQ(holder_of(d, l2, &found), proto::LeaseHolder::Renewing);
  r = d.core().take_chunk_renewals();
  ASSERT_EQ(r.size(), 1u);
  EXPECT_EQ(r[0].lease_id, l2);

  // Renewed: free again, and a waiting request gets them.
  Effects waiting = d.lease(other, 12 << 20, 5000);
  EXPECT_EQ(granted_lease(waiting, other), 0u) << "4 MiB are still renewing";
  Effects done;
  d.core().chunks_renewed(0, l2, "", done);
  EXPECT_FALSE(holder_of(d, l2, &found) == proto::LeaseHolder::Renewing && found);
  EXPECT_NE(granted_lease(done, other), 0u) << "the renewed memory served the waiting request";
}

TEST(CorePrograms, AProgramsSessionAndOutputSurviveACoordinatorRestart) {
  CoreDriver before(job_options(), 64ull << 20);
  Program p = start_program(before);
  before.request(p.agent.rid, p.agent.name, p.agent.session, proto::Body::JobUpdate,
                 [&](auto& fbb) {
                   proto::JobUpdateT u;
                   u.job_id = p.job;
                   u.attempt = 1;
                   u.status = proto::JobStatus::Running;
                   u.log = "before the restart\n";
                   u.epoch = std::make_unique<proto::EpochStatT>();  // a stored write
                   u.epoch->epoch = 1;
                   return proto::JobUpdate::Pack(fbb, &u).Union();
                 });
  auto rows = stored_rows(before);
  CoreDriver d(job_options(), 64ull << 20);
  Effects e;
  d.core().recover(rows, p.job + 1, d.now(), e);
  // The agent and its program live on: both register again.
  FakeAgent agent = d.register_agent("a", 11, {{p.job, 1, P::Running}});
  const std::string name = "a:job" + std::to_string(p.job);
  Effects reg = register_session(d, p, p.token);
  ASSERT_FALSE(messages(reg, proto::Body::RegisterAck, "rid-" + name).empty()) << errors(reg);
  EXPECT_EQ(d.job(p.job).state, JobState::Running);
  // Its output goes on where it was, without a gap.
  d.request(agent.rid, agent.name, agent.session, proto::Body::JobUpdate, [&](auto& fbb) {
    proto::JobUpdateT u;
    u.job_id = p.job;
    u.attempt = 1;
    u.status = proto::JobStatus::Running;
    u.log = "after\n";
    u.log_offset = 19;
    return proto::JobUpdate::Pack(fbb, &u).Union();
  });
  EXPECT_EQ(d.job(p.job).log, "before the restart\nafter\n");
}

TEST(CorePrograms, EnvironmentValuesAreShownOnlyToWhoMayActOnTheJob) {
  CoreDriver d(job_options(), 64ull << 20);
  d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id, [](proto::JobSpecT& s) {
    make_program(s);
    auto var = std::make_unique<proto::EnvVarT>();
    var->name = "WANDB_API_KEY";
    var->value = "secret-123";
    s.program->environment.push_back(std::move(var));
  });
  auto value_seen = [&](const Peer& as) {
    d.peer = as;
    Effects e = d.request("cli", "cli", {}, proto::Body::GetJob,
                          [&](auto& fbb) { return proto::CreateGetJob(fbb, id).Union(); });
    auto m = messages(e, proto::Body::JobInfo, "cli");
    if (m.empty()) throw std::logic_error(errors(e));
    const auto& env = m[0]->body.AsJobInfo()->spec->program->environment;
    return env.size() == 1 ? env[0]->name + "=" + env[0]->value : std::string("(none)");
  };
  const Peer owner = d.peer;
  EXPECT_EQ(value_seen(owner), "WANDB_API_KEY=secret-123");
  EXPECT_EQ(value_seen(Peer::local(3000, 3000, 5)), std::string("WANDB_API_KEY=") + kHiddenValue);
}

}  // namespace
}  // namespace leasehold::testing
