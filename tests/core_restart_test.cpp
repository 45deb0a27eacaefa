// The coordinator's core with a fake clock across a restart: what the job
// store kept comes back, and jobs that were running wait for their agent.
#include <gtest/gtest.h>

#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
using P = proto::JobPhase;

// A store as a coordinator killed with job 1 running on 'a' (epoch 2
// checkpointed) and job 2 queued would leave it.
std::vector<JobRecord> crashed_store(CoreDriver& before) {
  FakeAgent a = before.register_agent("a", 11);
  uint64_t j1 = 0, j2 = 0;
  before.submit(j1);
  before.submit(j2);
  before.heartbeat(a, {{j1, 1, P::Running}});
  before.update(a, j1, 1, "running", "", 1, true);
  before.update(a, j1, 1, "running", "", 2, true);
  return stored_rows(before);
}

TEST(CoreRestart, QueuedJobsKeepTheirOrderAndIdsAreNotReused) {
  CoreDriver before(job_options());
  auto rows = crashed_store(before);
  CoreDriver d(job_options());
  Effects e;
  d.core().recover(rows, 3, d.now(), e);
  EXPECT_EQ(d.job(2).state, JobState::Queued);
  uint64_t id = 0;
  d.submit(id);
  EXPECT_EQ(id, 3u);
  FakeAgent b = d.register_agent("b", 12);
  EXPECT_EQ(d.job(2).agent, "b") << "the older queued job first";
}

TEST(CoreRestart, AnAgentThatNoLongerRunsItsJobSendsItBackToTheQueue) {
  CoreDriver before(job_options());
  auto rows = crashed_store(before);
  CoreDriver d(job_options());
  Effects e;
  d.core().recover(rows, 3, d.now(), e);
  EXPECT_EQ(d.job(1).state, JobState::Running) << "waits for its agent";
  EXPECT_TRUE(d.job(1).orphaned_since.has_value());
  Effects reg;
  FakeAgent a = d.register_agent("a", 11, {}, &reg);
  const JobRecord& j = d.job(1);
  ASSERT_GE(j.history.size(), 3u);
  auto requeue = std::find_if(j.history.begin(), j.history.end(), [](const auto& h) {
    return h.reason.find("coordinator restarted") != std::string::npos;
  });
  ASSERT_NE(requeue, j.history.end());
  EXPECT_NE(requeue->reason.find("resuming from epoch 2"), std::string::npos) << requeue->reason;
  EXPECT_EQ(j.agent_failures, 0u) << "a restart is not the job's agent failing";
  EXPECT_EQ(j.state, JobState::Running) << "and a takes it again at once";
  EXPECT_EQ(assigned(reg, a), (std::vector<std::pair<uint64_t, uint32_t>>{{1, 2}}));
}

TEST(CoreRestart, AJobStillStoppingOnItsAgentIsNotStartedElsewhere) {
  CoreDriver before(job_options());
  auto rows = crashed_store(before);
  CoreDriver d(job_options());
  Effects e;
  d.core().recover(rows, 3, d.now(), e);
  FakeAgent b = d.register_agent("b", 12);  // idle: takes job 2, never job 1
  EXPECT_EQ(d.job(2).agent, "b");
  FakeAgent c = d.register_agent("c", 13);
  FakeAgent a = d.register_agent("a", 11, {{1, 1, P::Stopping}});
  EXPECT_EQ(d.job(1).state, JobState::Running);
  EXPECT_EQ(d.job(1).attempts.size(), 1u);
  d.advance(6000ms);  // past the recovery grace: a came back, so no timeout
  d.heartbeat(a, {{1, 1, P::Stopping}});
  d.heartbeat(b, {{2, 1, P::Running}});
  d.heartbeat(c);
  d.tick();
  EXPECT_EQ(d.job(1).attempts.size(), 1u);
  Effects rep = d.update(a, 1, 1, "interrupted", "the agent lost its coordinator session");
  EXPECT_EQ(messages(rep, proto::Body::Ack, a.rid).size(), 1u);
  EXPECT_EQ(d.job(1).state, JobState::Running);
  EXPECT_EQ(d.job(1).attempts.size(), 2u);
  EXPECT_NE(d.job(1).history[d.job(1).history.size() - 2].reason.find("resuming from epoch 2"),
            std::string::npos);
}

TEST(CoreRestart, AResultFinishedDuringTheRestartIsKept) {
  CoreDriver before(job_options());
  auto rows = crashed_store(before);
  CoreDriver d(job_options());
  Effects e;
  d.core().recover(rows, 3, d.now(), e);
  FakeAgent a = d.register_agent("a", 11, {{1, 1, P::Reporting}});
  d.update(a, 1, 1, "succeeded");
  EXPECT_EQ(d.job(1).state, JobState::Succeeded);
  EXPECT_EQ(d.job(1).attempts.size(), 1u) << "not run again";
}

TEST(CoreRestart, AnAgentThatNeverComesBackReleasesItsJobAfterTheGrace) {
  CoreDriver before(job_options());
  auto rows = crashed_store(before);
  CoreDriver d(job_options());
  Effects e;
  d.core().recover(rows, 3, d.now(), e);
  d.advance(4900ms);
  d.tick();
  EXPECT_EQ(d.job(1).state, JobState::Running);
  d.advance(200ms);
  d.tick();
  EXPECT_EQ(d.job(1).state, JobState::Queued);
  EXPECT_NE(d.job(1).reason.find("did not come back"), std::string::npos) << d.job(1).reason;
}

TEST(CoreRestart, ACancelledRunningJobIsCancelledWhenItsAgentReports) {
  CoreDriver before(job_options());
  auto rows = crashed_store(before);
  rows[0].cancel_requested = true;
  CoreDriver d(job_options());
  Effects e;
  d.core().recover(rows, 3, d.now(), e);
  d.register_agent("a", 11);
  EXPECT_EQ(d.job(1).state, JobState::Cancelled);
}

}  // namespace
}  // namespace leasehold::testing
