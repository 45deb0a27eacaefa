// The coordinator's core with a fake clock: what a hostile or careless peer
// can do to jobs, and what stops it. Assignments nobody acknowledges, who
// may cancel, the bounds on every list that grows, reasons that would
// forge a log line, listings that would outgrow a message.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "coordinator/job_codec.h"
#include "coordinator/wire.h"
#include "shared/protocol.h"
#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
using P = proto::JobPhase;

// An agent that heart-beats but never takes its job (a fake agent, one
// stuck) does not keep it: after the assign timeout the job goes back to
// the queue uncharged and runs elsewhere; that agent gets nothing more in
// its session, and a cancelled job in the same spot ends.
TEST(CoreJobs, AnAssignmentNeverAcknowledgedGoesBackToTheQueue) {
  CoreDriver d(job_options());
  FakeAgent fake = d.register_agent("fake", 11);
  uint64_t id = 0;
  ASSERT_EQ(assigned(d.submit(id), fake).size(), 1u);
  for (int i = 0; i < 9; ++i) {
    d.advance(1000ms);
    d.heartbeat(fake);  // alive, but never lists the job
    d.tick();
  }
  EXPECT_EQ(d.job(id).state, JobState::Running) << "not before the timeout";
  d.advance(1100ms);
  d.heartbeat(fake);
  Effects t = d.tick();
  EXPECT_EQ(d.job(id).state, JobState::Queued);
  EXPECT_EQ(d.job(id).agent_failures, 0u) << "not charged";
  EXPECT_TRUE(stops(t, fake, id)) << "told to drop it, in case it had it";
  EXPECT_NE(d.job(id).reason.find("did not acknowledge the assignment within 10000 ms"),
            std::string::npos)
      << d.job(id).reason;
  FakeAgent real = d.register_agent("real", 12);
  EXPECT_EQ(d.job(id).state, JobState::Running);
  EXPECT_EQ(d.job(id).agent, "real") << "the fake gets no more jobs";

  uint64_t second = 0;
  d.submit(second);
  EXPECT_EQ(d.job(second).state, JobState::Queued) << "nothing for the fake";
  // A cancel of a job whose agent never takes it ends it at the timeout.
  CoreDriver e(job_options());
  FakeAgent stuck = e.register_agent("stuck", 21);
  uint64_t job = 0;
  e.submit(job);
  e.cancel(job);
  for (int i = 0; i < 11; ++i) {
    e.advance(1000ms);
    e.heartbeat(stuck);
    e.tick();
  }
  EXPECT_EQ(e.job(job).state, JobState::Cancelled);
}

// A job records who submitted it; only that user (or root, the
// coordinator's user, an admin_group member) may cancel it.
TEST(CoreJobs, OnlyTheSubmitterOrAnAdministratorCancelsAJob) {
  CoreDriver d(job_options());
  uint64_t id = 0;
  d.submit(id);  // by uid 1000
  EXPECT_EQ(d.job(id).submitted_uid, std::optional<uint32_t>(1000));
  d.peer = Peer::local(2000, 2000, 99);
  Effects refused = d.cancel(id);
  EXPECT_NE(errors(refused).find("job 1 was submitted by"), std::string::npos) << errors(refused);
  EXPECT_NE(errors(refused).find("admin_group is not set"), std::string::npos) << errors(refused);
  EXPECT_EQ(d.job(id).state, JobState::Queued) << "unchanged";
  EXPECT_FALSE(refused.writes_store());
  d.peer = Peer{};  // tcp: nobody the kernel vouches for
  EXPECT_NE(errors(d.cancel(id)).find("submitted by"), std::string::npos);
  d.peer = Peer::local(0, 0, 1);  // root
  d.cancel(id);
  EXPECT_EQ(d.job(id).state, JobState::Cancelled);
  uint64_t mine = 0;
  d.peer = Peer::local(1000, 1000, 4242);
  d.submit(mine);
  d.cancel(mine);
  EXPECT_EQ(d.job(mine).state, JobState::Cancelled) << "the submitter cancels their own";
}

// Every list a job or an agent can grow is bounded, and hitting a bound is
// an error naming the option; what was kept is intact.
TEST(CoreJobs, QueuesEpochsHistoryAndWaitingRequestsAreBounded) {
  CoreOptions o = job_options();
  o.queued_per_user = 2;
  o.epochs_kept = 3;
  o.history_kept = 4;
  o.waiting_per_agent = 1;
  CoreDriver d(o, 64ull << 20);
  uint64_t a = 0, b = 0, c = 0;
  d.submit(a);
  d.submit(b);
  try {
    d.submit(c);  // expects a file check, so a refusal throws with its text
    ADD_FAILURE() << "a third job was taken";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("the limit (queued_per_user 2)"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(d.core().jobs().all().size(), 2u);
  d.peer = Peer::local(2000, 2000, 7);
  uint64_t other = 0;
  d.submit(other);
  EXPECT_NE(other, 0u) << "another user's queue is their own";

  FakeAgent w = d.register_agent("w", 11);
  ASSERT_EQ(d.job(a).agent, "w");
  d.heartbeat(w, {{a, 1, P::Running}});
  for (int epoch = 1; epoch <= 5; ++epoch) d.update(w, a, 1, "running", "", epoch);
  const JobRecord& job = d.job(a);
  ASSERT_EQ(job.epochs.size(), 3u);
  EXPECT_EQ(job.epochs.front().epoch, 3) << "the latest kept";
  EXPECT_EQ(job_info(job, kFullDetail)->epochs_total, 5u);
  // Round trip through the store keeps the totals.
  JobRecord back = decode_job(job.id, encode_job(job));
  EXPECT_EQ(job_info(back, kFullDetail)->epochs_total, 5u);
  for (int i = 0; i < 3; ++i) {  // requeue, run again: history grows
    d.update(w, a, job.attempt_number(), "interrupted", "test");
    d.heartbeat(w, {{a, job.attempt_number(), P::Running}});
  }
  EXPECT_LE(d.job(a).history.size(), 4u);
  EXPECT_GT(job_info(d.job(a), kFullDetail)->history_total, 4u);

  FakeAgent l = d.register_agent("l", 12, {}, nullptr, false);
  ASSERT_EQ(errors(d.lease(l, 64ull << 20, 0)), "") << "the whole pool";
  FakeAgent m = d.register_agent("m", 13, {}, nullptr, false);
  EXPECT_TRUE(errors(d.lease(m, 1 << 20, 5000)).empty()) << "one may wait";
  Effects second = d.lease(m, 1 << 20, 5000);
  EXPECT_NE(errors(second).find("the limit (waiting_per_agent 1)"), std::string::npos)
      << errors(second);
  EXPECT_EQ(d.core().device(0).leases.waiting(), 1u);
}

// The longest wait a request may ask for and the longest job are options;
// a request over either is refused naming it, and a region waiter counts
// toward waiting_per_agent like a waiting lease. Nothing waits or queues
// because of a refused request.
TEST(CoreJobs, LongWaitsAndLongJobsAreRefusedNamingTheirLimit) {
  CoreOptions o = job_options();
  o.max_lease_wait = 10s;
  o.lease_wait_timeout = 5s;  // the default wait is within the longest (validated at start-up)
  o.waiting_per_agent = 1;
  o.job_limits = {10, 1000};
  CoreDriver d(o, 64ull << 20);

  uint64_t id = 0;
  // (CoreDriver::submit throws with the refusal's text.)
  auto refusal = [&](const std::function<void(proto::JobSpecT&)>& edit) -> std::string {
    try {
      d.submit(id, edit);
    } catch (const std::logic_error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(refusal([](proto::JobSpecT& s) {
              s.epochs = 11;
            }).find("epochs: 11 is over the limit (max_epochs 10)"),
            std::string::npos);
  const std::string steps = refusal([](proto::JobSpecT& s) {
    s.epochs = 0;
    s.steps = 1001;
  });
  EXPECT_NE(steps.find("steps: 1001 is over the limit (max_steps 1000)"), std::string::npos)
      << steps;
  EXPECT_TRUE(d.core().jobs().all().empty());
  d.submit(id, [](proto::JobSpecT& s) { s.epochs = 10; });
  EXPECT_NE(id, 0u) << "at the limit is allowed";
  d.cancel(id);  // its reservation would keep the regions below out

  FakeAgent f = d.register_agent("filler", 12, {}, nullptr, false);
  FakeAgent m = d.register_agent("m", 13, {}, nullptr, false);
  ASSERT_TRUE(region_grant(d.attach(f, "r", 1 << 20, true), f));
  Effects too_long = d.attach(m, "r", 0, false, 10001);
  EXPECT_EQ(error_code(too_long, m.rid), ErrorCode::InvalidArgument);
  EXPECT_NE(errors(too_long).find("longer than the limit (max_lease_wait 10000 ms)"),
            std::string::npos)
      << errors(too_long);
  EXPECT_TRUE(d.attach(m, "r", 0, false, 10000).messages.empty()) << "waits for the filler";
  ASSERT_TRUE(region_grant(d.attach(f, "s", 1 << 20, true), f));
  Effects second = d.attach(m, "s", 0, false, 5000);
  EXPECT_NE(errors(second).find("the limit (waiting_per_agent 1)"), std::string::npos)
      << errors(second);
  Effects lease = d.lease(m, 1 << 20, 5000);
  EXPECT_EQ(error_code(lease, m.rid), ErrorCode::NoSpace);
  EXPECT_NE(errors(lease).find("the limit (waiting_per_agent 1)"), std::string::npos)
      << errors(lease);
  Effects long_lease = d.lease(f, 1 << 20, 20000);
  EXPECT_NE(errors(long_lease).find("(max_lease_wait 10000 ms)"), std::string::npos)
      << errors(long_lease);
  EXPECT_EQ(d.core().device(0).leases.waiting(), 0u);
}

// A fake agent that acknowledges its job and then ignores StopJob does not
// keep a cancelled job running: after stop_timeout it ends as cancelled,
// and that agent gets no more jobs in its session.
TEST(CoreJobs, ACancelEndsAJobWhoseAgentIgnoresStopJob) {
  CoreOptions o = job_options();
  o.stop_timeout = 5s;
  CoreDriver d(o);
  FakeAgent fake = d.register_agent("fake", 11);
  uint64_t id = 0, next = 0;
  d.submit(id);
  d.heartbeat(fake, {{id, 1, P::Running}});  // acknowledged
  d.cancel(id);
  for (int i = 0; i < 4; ++i) {
    d.advance(1000ms);
    EXPECT_TRUE(stops(d.heartbeat(fake, {{id, 1, P::Running}}), fake, id) ||
                stops(d.tick(), fake, id))
        << "told again while it runs";
  }
  EXPECT_EQ(d.job(id).state, JobState::Running) << "not before stop_timeout";
  d.advance(1100ms);
  d.heartbeat(fake, {{id, 1, P::Running}});
  d.tick();
  EXPECT_EQ(d.job(id).state, JobState::Cancelled);
  EXPECT_NE(d.job(id).reason.find("did not stop it within 5000 ms (stop_timeout)"),
            std::string::npos)
      << d.job(id).reason;
  d.submit(next);
  d.heartbeat(fake, {{id, 1, P::Running}});
  d.tick();
  EXPECT_EQ(d.job(next).state, JobState::Queued) << "the fake agent gets nothing more";
  FakeAgent real = d.register_agent("real", 12);
  EXPECT_EQ(d.job(next).agent, "real");
}

// An agent that reports its job interrupted again and again (each one
// uncounted, so the job comes straight back to it) cannot grow the job's
// record without bound, and neither can long reasons: attempts and history
// keep the latest, reasons are cut, and a listing page of such jobs and a
// job event stay small.
TEST(CoreJobs, AttemptsAndReasonsAreBoundedSoRepliesStaySmall) {
  CoreOptions o = job_options();
  o.history_kept = 10;
  CoreDriver d(o);
  FakeAgent w = d.register_agent("w", 11);
  uint64_t id = 0;
  d.submit(id);
  const std::string essay(100000, 'x');
  for (int i = 0; i < 50; ++i) {
    const uint32_t attempt = d.job(id).attempt_number();
    d.heartbeat(w, {{id, attempt, P::Running}});
    d.update(w, id, attempt, "interrupted", essay);
    ASSERT_EQ(d.job(id).agent, "w") << "back on the same agent";
  }
  const JobRecord& job = d.job(id);
  EXPECT_EQ(job.attempt_number(), 51u);
  EXPECT_LE(job.attempts.size(), 10u);
  EXPECT_LE(job.history.size(), 10u);
  for (const auto& a : job.attempts) EXPECT_LE(a.reason.size(), kReasonBytes + 8);
  for (const auto& h : job.history) EXPECT_LE(h.reason.size(), kReasonBytes + 8);
  EXPECT_EQ(d.job(id).state, JobState::Running);
  // What the coordinator itself keeps is cut too.
  JobTable table;
  JobRecord& other = table.add(std::make_shared<proto::JobSpecT>(CoreDriver::small_job("o")), 0);
  table.set_state(other, JobState::Failed, 1, std::string(5000, 'y'));
  EXPECT_LE(other.reason.size(), kReasonBytes + 8);
  EXPECT_LE(other.history.back().reason.size(), kReasonBytes + 8);
  // The event says how it goes, not all it went through.
  zmq::message_t event = encode_event(job);
  EXPECT_LE(event.size(), 8u * 1024) << "a job event is progress, not the record";
  Effects list = d.request("cli", "cli", {}, proto::Body::ListJobs, [](auto& fbb) {
    return proto::CreateListJobs(fbb, uint64_t{0}).Union();
  });
  auto pages = messages(list, proto::Body::JobList);
  ASSERT_EQ(pages.size(), 1u);
  EXPECT_LE(pages[0]->body.AsJobList()->jobs[0]->attempts.size(), 5u);
  EXPECT_EQ(pages[0]->body.AsJobList()->jobs[0]->attempts.back()->number, 51u)
      << "the latest attempt's number counts them";
}

// Heartbeats and registrations list the jobs an agent has; a list no agent
// could have (each entry may cost a StopJob and a log line) is refused.
TEST(CoreJobs, AnAgentListingThousandsOfJobsIsRefused) {
  CoreDriver d(job_options());
  FakeAgent w = d.register_agent("w", 11);
  std::vector<Listed> many;
  for (uint64_t j = 1000; j < 3000; ++j) many.push_back({j, 1, P::Running});
  Effects e = d.heartbeat(w, many);
  EXPECT_EQ(error_code(e, w.rid), ErrorCode::InvalidArgument);
  EXPECT_NE(errors(e).find("lists 2000 jobs; an agent runs at most 8"), std::string::npos)
      << errors(e);
  EXPECT_TRUE(messages(e, proto::Body::StopJob).empty()) << "no StopJob for made-up jobs";
  EXPECT_THROW(d.register_agent("v", 12, many), std::logic_error);
  EXPECT_FALSE(d.core().agents().count("v"));
}

// After a restart a running job waits for its agent by name. Another
// user's agent taking that name first does not get the job: the name is
// refused while the job waits, and the job's own agent takes it back.
TEST(CoreJobs, AnotherUsersAgentCannotClaimAJobByItsAgentsName) {
  CoreDriver before(job_options());
  FakeAgent a = before.register_agent("a", 11);
  uint64_t id = 0;
  before.submit(id);
  before.heartbeat(a, {{id, 1, P::Running}});
  ASSERT_EQ(before.job(id).attempts.back().agent_identity, "uid 1000");
  CoreDriver d(job_options());
  Effects e;
  d.core().recover(stored_rows(before), id + 1, d.now(), e);
  d.peer = Peer::local(2000, 2000, 99);
  Effects claim = d.request("thief", "a", {}, proto::Body::Register, [&](auto& fbb) {
    std::vector<flatbuffers::Offset<proto::AgentJob>> jobs{
        proto::CreateAgentJob(fbb, id, 1, P::Running)};
    return proto::CreateRegister(fbb, fbb.CreateString("a"), 99, -1, fbb.CreateVector(jobs))
        .Union();
  });
  EXPECT_EQ(error_code(claim, "thief"), ErrorCode::NameTaken) << errors(claim);
  EXPECT_NE(errors(claim).find("belongs to another user's agent, whose job 1 waits"),
            std::string::npos)
      << errors(claim);
  EXPECT_FALSE(d.core().agents().count("a"));
  d.peer = Peer::local(1000, 1000, 4242);
  FakeAgent back = d.register_agent("a", 11, {{id, 1, P::Running}});
  EXPECT_EQ(d.job(id).state, JobState::Running);
  EXPECT_FALSE(d.job(id).orphaned_since) << "its own agent took it back";
  Effects done = d.update(back, id, 1, "succeeded");
  EXPECT_EQ(d.job(id).state, JobState::Succeeded);
}

// An agent's words (a failure reason) are logged, stored and shown as JSON:
// control characters and bytes that are not UTF-8 arrive escaped.
TEST(CoreJobs, AReasonCannotForgeALogLineOrBreakJson) {
  CoreDriver d(job_options());
  FakeAgent w = d.register_agent("w", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(w, {{id, 1, P::Running}});
  d.update(w, id, 1, "failed", "boom\n[2026-11-25 01:00:00.000] [info] job 1 succeeded\xff");
  const std::string& reason = d.job(id).reason;
  EXPECT_EQ(reason.find('\n'), std::string::npos) << reason;
  EXPECT_NE(reason.find("boom\\x0a[2026"), std::string::npos) << reason;
  EXPECT_NE(reason.find("succeeded\\xff"), std::string::npos) << reason;
  EXPECT_NO_THROW(nlohmann::json(reason).dump()) << "valid UTF-8";
}

// Over tcp:// the kernel vouches for no uid: a job is recorded under the
// CURVE key that submitted it, and only that key (or an administrator on
// ipc://) may cancel it.
TEST(CoreJobs, OverTheNetworkAJobBelongsToItsKey) {
  CoreDriver d(job_options());
  d.peer = Peer::with_key("alice");
  uint64_t id = 0;
  d.submit(id);
  EXPECT_EQ(d.job(id).submitted_by, "key alice");
  EXPECT_FALSE(d.job(id).submitted_uid);
  d.peer = Peer::with_key("bob");
  Effects refused = d.cancel(id);
  EXPECT_NE(errors(refused).find("job 1 was submitted by key alice"), std::string::npos)
      << errors(refused);
  EXPECT_EQ(d.job(id).state, JobState::Queued) << "unchanged";
  d.peer = Peer{};  // neither a uid nor a key
  EXPECT_NE(errors(d.cancel(id)).find("submitted by key alice"), std::string::npos);
  d.peer = Peer::local(1000, 1000, 7);  // a local user is not the key's owner either
  EXPECT_NE(errors(d.cancel(id)).find("submitted by key alice"), std::string::npos);
  d.peer = Peer::with_key("alice");
  d.cancel(id);
  EXPECT_EQ(d.job(id).state, JobState::Cancelled);
}

TEST(CoreJobs, ListingPagesStayFarBelowTheMessageLimit) {
  CoreOptions o = job_options();
  o.retention_count = 100000;
  CoreDriver d(o);
  FakeAgent a = d.register_agent("a", 11);
  const std::string long_name(120, 'n');
  for (int i = 0; i < 1000; ++i) {
    uint64_t id = 0;
    d.submit(id, [&](proto::JobSpecT& s) { s.name = long_name + std::to_string(i % 10); });
  }
  // The running job has a long history of epochs.
  uint64_t running = d.core().agents().at("a").job_id;
  for (int ep = 1; ep <= 3000; ++ep) d.update(a, running, 1, "running", "", ep, ep % 2 == 0);
  uint64_t after = 0, seen = 0;
  bool more = true;
  while (more) {
    Effects e = d.request("cli", "cli", {}, proto::Body::ListJobs,
                          [&](auto& fbb) { return proto::CreateListJobs(fbb, after).Union(); });
    auto pages = messages(e, proto::Body::JobList);
    ASSERT_EQ(pages.size(), 1u);
    const auto* list = pages[0]->body.AsJobList();
    EXPECT_LE(encode_message(*pages[0]).size(), kMaxMessageBytes / 2);
    for (const auto& j : list->jobs) {
      EXPECT_EQ(j->id, after + 1);
      after = j->id;
      ++seen;
      EXPECT_FALSE(j->spec) << "summaries carry no spec";
    }
    more = list->more;
  }
  EXPECT_EQ(seen, 1000u);
  Effects one = d.request("cli", "cli", {}, proto::Body::GetJob,
                          [&](auto& fbb) { return proto::CreateGetJob(fbb, running).Union(); });
  auto info = messages(one, proto::Body::JobInfo);
  ASSERT_EQ(info.size(), 1u);
  EXPECT_EQ(info[0]->body.AsJobInfo()->epochs_total, 3000u);
  EXPECT_LE(encode_message(*info[0]).size(), kMaxMessageBytes);
}

}  // namespace
}  // namespace leasehold::testing
