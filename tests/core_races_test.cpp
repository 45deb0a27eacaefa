// The coordinator's core with a fake clock: the races between a job's
// agent, its messages and the store. Every rule here is one a real
// deployment meets only by bad luck.
#include <gtest/gtest.h>

#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
using P = proto::JobPhase;

bool acked_after_store(const Effects& e, const FakeAgent& a) {
  auto acks = messages(e, proto::Body::Ack, a.rid);
  return e.writes_store() && acks.size() == 1 && acks[0]->after_store;
}

TEST(CoreRaces, AnAssignmentSentAgainLeavesOnlyAfterTheStore) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  Effects first = d.submit(id);
  auto pushes = messages(first, proto::Body::AssignJob, a.rid);
  ASSERT_EQ(pushes.size(), 1u);
  EXPECT_TRUE(pushes[0]->after_store);
  d.heartbeat(a);
  d.advance(1100ms);
  Effects again = d.tick();
  auto resent = messages(again, proto::Body::AssignJob, a.rid);
  ASSERT_EQ(resent.size(), 1u);
  EXPECT_TRUE(resent[0]->after_store && again.writes_store())
      << "a resend must not overtake the write of the assignment";
}

TEST(CoreRaces, ACancelSentAgainIsAcknowledgedOnlyAfterTheStore) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  Effects first = d.cancel(id);
  auto stop = stop_of(first, a, id);
  ASSERT_TRUE(stop);
  EXPECT_TRUE(stop->cancel);
  Effects again = d.cancel(id);
  auto acks = messages(again, proto::Body::Ack, "client");
  ASSERT_EQ(acks.size(), 1u);
  EXPECT_TRUE(acks[0]->after_store && again.writes_store());
  d.update(a, id, 1, "cancelled", "cancelled by request");
  Effects late = d.cancel(id);
  auto errs = messages(late, proto::Body::Error, "client");
  ASSERT_EQ(errs.size(), 1u);
  EXPECT_TRUE(errs[0]->after_store && late.writes_store()) << "'already cancelled', once stored";
}

TEST(CoreRaces, AnAgentThatNoLongerListsItsJobLosesItBackToTheQueue) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  // Its final report was lost (refused and dropped, say); it runs nothing.
  Effects e = d.heartbeat(a, {});
  const JobRecord& j = d.job(id);
  EXPECT_EQ(j.attempts.size(), 2u) << "requeued and given to the idle agent again";
  EXPECT_EQ(j.attempts[0].outcome, "interrupted");
  EXPECT_NE(j.attempts[0].reason.find("no longer has it"), std::string::npos);
  EXPECT_EQ(j.agent_failures, 0u);
  EXPECT_EQ(assigned(e, a), (std::vector<std::pair<uint64_t, uint32_t>>{{id, 2}}));
}

TEST(CoreRaces, TheResultOfAnAttemptThatWasRequeuedIsRefusedNotAcknowledged) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  Effects unreg = d.request(a.rid, a.name, a.session, proto::Body::Unregister,
                            [](auto& fbb) { return proto::CreateUnregister(fbb).Union(); });
  EXPECT_EQ(d.job(id).state, JobState::Queued);
  EXPECT_EQ(d.job(id).agent_failures, 0u) << "an agent leaving in order is not a lost agent";
  FakeAgent again = d.register_agent("a", 11, {}, nullptr, false);  // takes nothing now
  // The old attempt's result arrives late, from the same agent name.
  Effects late = d.update(again, id, 1, "succeeded");
  EXPECT_NE(errors(late).find("has ended (interrupted)"), std::string::npos) << errors(late);
  EXPECT_NE(d.job(id).state, JobState::Succeeded);
}

TEST(CoreRaces, AnInterruptionIsNotCountedAgainstMaxAttempts) {
  CoreDriver d(job_options());
  uint64_t id = 0;
  d.submit(id, [](proto::JobSpecT& s) { s.max_attempts = 0; });
  FakeAgent a = d.register_agent("a", 11);
  for (uint32_t attempt = 1; attempt <= 3; ++attempt) {
    d.heartbeat(a, {{id, attempt, P::Running}});
    Effects e = d.update(a, id, attempt, "interrupted", "agent 'a' is stopping");
    EXPECT_TRUE(acked_after_store(e, a));
  }
  EXPECT_EQ(d.job(id).agent_failures, 0u);
  EXPECT_EQ(d.job(id).state, JobState::Running) << "max_attempts 0, yet still retried";
  EXPECT_EQ(d.job(id).attempts.size(), 4u);
}

TEST(CoreRaces, AnAgentRegisteringAgainWhileItsJobStopsKeepsItAndItsMemoryFenced) {
  CoreDriver d(job_options(), 64ull << 20);
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  d.lease(a, 40 << 20, 0);
  FakeAgent b = d.register_agent("b", 12, {}, nullptr, false);
  Effects waiting = d.lease(b, 30 << 20, 60000);
  EXPECT_TRUE(waiting.messages.empty());
  // a lost its session (a late reply) and registers again, still running.
  Effects reg;
  FakeAgent a2 = d.register_agent("a", 11, {{id, 1, P::Running}}, &reg);
  auto stop = stop_of(reg, a2, id);
  ASSERT_TRUE(stop) << "its old leases are void: it must stop";
  EXPECT_FALSE(stop->cancel);
  EXPECT_TRUE(messages(reg, proto::Body::LeaseGrant).empty()) << "its memory may still be in use";
  EXPECT_EQ(d.job(id).state, JobState::Running);
  EXPECT_EQ(d.job(id).attempts.size(), 1u);
  Effects stopping = d.heartbeat(a2, {{id, 1, P::Stopping}});
  EXPECT_TRUE(messages(stopping, proto::Body::LeaseGrant).empty());
  Effects reported = d.update(a2, id, 1, "interrupted", "the agent lost its coordinator session");
  EXPECT_TRUE(acked_after_store(reported, a2));
  Effects done = d.heartbeat(a2, {});
  EXPECT_EQ(messages(done, proto::Body::LeaseGrant, b.rid).size(), 1u)
      << "stopped: the fenced memory goes to the waiting request";
  EXPECT_EQ(d.job(id).agent_failures, 0u);
  EXPECT_EQ(d.job(id).attempts.size(), 2u);
}

TEST(CoreRaces, ASilentLiveAgentsJobWaitsAndCountsOnlyIfItNeverComesBack) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  FakeAgent b = d.register_agent("b", 12);
  d.stopped.insert(11);  // SIGSTOP: silent at once
  d.advance(2300ms);
  d.heartbeat(b);
  d.tick();
  EXPECT_FALSE(d.core().agents().count("a"));
  EXPECT_EQ(d.job(id).state, JobState::Running) << "not started on b while a may still run it";
  EXPECT_EQ(d.job(id).attempts.size(), 1u);
  d.advance(4000ms);
  d.heartbeat(b);
  d.tick();
  EXPECT_EQ(d.job(id).attempts.size(), 1u);
  d.advance(1100ms);
  d.heartbeat(b);
  d.tick();
  EXPECT_EQ(d.job(id).agent, "b");
  EXPECT_EQ(d.job(id).attempts.size(), 2u);
  EXPECT_EQ(d.job(id).agent_failures, 1u);
  EXPECT_NE(d.job(id).attempts[0].reason.find("fell silent"), std::string::npos);
}

TEST(CoreRaces, ASilentAgentWhoseProcessEndsLosesItsJobAtOnce) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  FakeAgent b = d.register_agent("b", 12);
  d.stopped.insert(11);  // SIGSTOP: silent at once
  d.advance(2300ms);
  d.heartbeat(b);
  d.tick();  // stopped, then killed: exiting takes a while (a GPU context)
  EXPECT_EQ(d.job(id).attempts.size(), 1u);
  d.gone.insert(11);
  d.advance(300ms);
  d.heartbeat(b);
  d.tick();
  EXPECT_EQ(d.job(id).agent, "b") << "requeued as soon as the process ended, not after the grace";
  EXPECT_EQ(d.job(id).agent_failures, 1u);
  EXPECT_NE(d.job(id).attempts[0].reason.find("died"), std::string::npos);
}

TEST(CoreRaces, AStrayJobIsStoppedAgainEachIntervalWhateverElseTheAgentRuns) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11, {{40, 2, P::Running}, {41, 1, P::Running}});
  d.advance(600ms);
  Effects soon = d.heartbeat(a, {{40, 2, P::Running}, {41, 1, P::Running}});
  EXPECT_FALSE(stops(soon, a, 40));
  d.advance(500ms);
  Effects later = d.heartbeat(a, {{40, 2, P::Running}, {41, 1, P::Running}});
  EXPECT_TRUE(stops(later, a, 40));
  EXPECT_TRUE(stops(later, a, 41)) << "each stray job has its own resend clock";
  ASSERT_TRUE(stop_of(later, a, 41));
  EXPECT_FALSE(stop_of(later, a, 41)->cancel);
}

TEST(CoreRaces, RetentionLeavesACheckpointFolderTheJobFileNamed) {
  CoreOptions o = job_options();
  o.retention_count = 1;
  CoreDriver d(o);
  uint64_t own = 0, theirs = 0, last = 0;
  d.submit(own);
  d.submit(theirs, [](proto::JobSpecT& s) {
    s.checkpoint = std::make_unique<proto::CheckpointSpecT>();
    s.checkpoint->directory = "/home/user/ckpt";
  });
  d.submit(last);
  for (uint64_t id : {own, theirs, last}) {
    d.cancel(id);
    d.advance(1000ms);
  }
  Effects e = d.tick();
  EXPECT_EQ(e.store_deletes.size(), 2u);
  EXPECT_EQ(e.remove_dirs,
            std::vector<std::string>{"/var/lib/leasehold-test/checkpoints/" + std::to_string(own)});
}

// Every interruption is counted with its cause, in the job (all of them,
// for `leasehold job` and `jobs`) and in the core (for /metrics).
TEST(CoreRaces, InterruptionsAreCountedPerCauseInTheJobAndTheCore) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  d.gone.insert(11);  // its agent died
  d.advance(250ms);
  d.tick();
  FakeAgent b = d.register_agent("b", 12);
  ASSERT_EQ(d.job(id).agent, "b");
  d.heartbeat(b, {{id, 2, P::Running}});
  d.update(b, id, 2, "interrupted", "agent 'b' is stopping (SIGTERM)");
  const JobRecord& j = d.job(id);
  EXPECT_EQ(j.interruptions, (std::map<std::string, uint32_t>{{"agent_died", 1},
                                                              {"agent_stopped", 1}}));
  ASSERT_EQ(j.attempts.size(), 3u);  // requeued, and on b again
  EXPECT_EQ(j.attempts[0].cause, "agent_died");
  EXPECT_EQ(j.attempts[1].cause, "agent_stopped");
  EXPECT_EQ(d.core().interruptions().at(Interruption::AgentDied), 1u);
  EXPECT_EQ(d.core().interruptions().at(Interruption::AgentStopped), 1u);
  // Stored and read back whole.
  auto rows = stored_rows(d);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].interruptions, j.interruptions);
  EXPECT_EQ(rows[0].attempts[1].cause, "agent_stopped");
  // Who cancelled is recorded.
  d.cancel(id);
  EXPECT_FALSE(d.job(id).cancelled_by.empty());
}

}  // namespace
}  // namespace leasehold::testing
