// Data-parallel jobs (JobSpec.replicas) in the core, with a fake clock:
// replicas start together on distinct devices or not at all, a waiting
// gang holds nothing, and a replica lost, failed or cancelled ends the
// whole gang's attempt.
#include <gtest/gtest.h>

#include "coordinator/occupancy_policy.h"
#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

constexpr uint64_t MiB = 1ull << 20;

class GangsTest : public ::testing::Test {
 protected:
  // Two host devices of 64 MiB under the occupancy policy.
  GangsTest()
      : d(job_options(), std::vector<uint64_t>{64 * MiB, 64 * MiB},
          std::make_unique<OccupancyPolicy>(OccupancyOptions{})) {}

  FakeAgent worker(const std::string& name, int pid, int device) {
    return d.register_agent(name, pid, {}, nullptr, true, device);
  }
  uint64_t job_on(const FakeAgent& a) { return d.core().agents().at(a.name).job_id; }

  // A job of `replicas` replicas, each guaranteed `mib` MiB.
  uint64_t submit(int mib, int replicas, Effects* effects = nullptr) {
    uint64_t id = 0;
    Effects e = d.submit(id, [&](proto::JobSpecT& s) {
      s.memory_budget = std::to_string(mib) + "MiB";
      s.replicas = replicas;
    });
    if (effects) *effects = std::move(e);
    return id;
  }

  // The AssignJob pushed to `a` in `e`.
  static const proto::AssignJobT* assignment(const Effects& e, const FakeAgent& a) {
    auto m = messages(e, proto::Body::AssignJob, a.rid);
    return m.empty() ? nullptr : m[0]->body.AsAssignJob();
  }

  // Every agent that holds a job or a lease, for "nothing is held".
  size_t busy_agents() {
    size_t n = 0;
    for (const auto& [name, a] : d.core().agents()) n += a.job_id != 0;
    return n;
  }

  CoreDriver d;
};

TEST_F(GangsTest, ReplicasStartTogetherOnDistinctDevicesWithTheirRanks) {
  FakeAgent w0 = worker("w0", 100, 0), w0b = worker("w0b", 101, 0), w1 = worker("w1", 102, 1);
  Effects e;
  const uint64_t job = submit(8, 2, &e);
  ASSERT_EQ(d.job(job).state, JobState::Running) << d.job(job).waiting_for;
  const auto* r0 = assignment(e, w0);
  const auto* r1 = assignment(e, w1);
  ASSERT_NE(r0, nullptr) << errors(e);
  ASSERT_NE(r1, nullptr) << "rank 1 goes to the other device, not to w0b beside rank 0";
  EXPECT_EQ(assignment(e, w0b), nullptr);
  EXPECT_EQ(r0->rank, 0);
  EXPECT_EQ(r1->rank, 1);
  EXPECT_EQ(r0->world_size, 2);
  EXPECT_EQ(r1->world_size, 2);
  EXPECT_EQ(r0->master_addr, "127.0.0.1");
  EXPECT_NE(r0->master_port, 0);
  EXPECT_EQ(r0->master_port, r1->master_port);
  EXPECT_EQ(d.job(job).agent, "w0");
  EXPECT_EQ(d.job(job).attempts.back().replica_agents, std::vector<std::string>{"w1"});
  // The replica agents are stored with the attempt.
  const auto rows = stored_rows(d);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].attempts.back().replica_agents, std::vector<std::string>{"w1"});
  // Both acknowledge; rank 1's success does not end the job, rank 0's does.
  d.heartbeat(w0, {{job, 1, proto::JobPhase::Running}});
  d.heartbeat(w1, {{job, 1, proto::JobPhase::Running}});
  e = d.update(w1, job, 1, "succeeded");
  EXPECT_EQ(errors(e), "");
  EXPECT_EQ(d.job(job).state, JobState::Running);
  // Its report delivered, rank 1's agent lists the job no more: that is
  // no lost job while rank 0 still trains (it evaluates, checkpoints).
  d.heartbeat(w1, {});
  d.heartbeat(w0, {{job, 1, proto::JobPhase::Running}});
  EXPECT_EQ(d.job(job).state, JobState::Running) << d.job(job).reason;
  EXPECT_EQ(job_on(w1), job) << "rank 1's agent is the gang's until it ends";
  e = d.update(w0, job, 1, "succeeded");
  EXPECT_EQ(d.job(job).state, JobState::Succeeded);
  EXPECT_FALSE(stops(e, w1, job)) << "a gang that succeeded is not stopped";
  EXPECT_EQ(busy_agents(), 0u);
}

TEST_F(GangsTest, GangAdmissionIsAllOrNothingUnderContention) {
  // Two workers per device; device 1 is half full (a leasing client).
  FakeAgent l1 = d.register_agent("l1", 99, {}, nullptr, false, 1);
  const uint64_t lease = granted_lease(d.lease(l1, 32 * MiB, 0), l1);
  ASSERT_NE(lease, 0u);
  FakeAgent w0 = worker("w0", 100, 0), w0b = worker("w0b", 101, 0);
  FakeAgent w1 = worker("w1", 102, 1), w1b = worker("w1b", 103, 1);
  // Gang A (2 × 24 MiB) fits both devices and starts.
  const uint64_t a = submit(24, 2);
  ASSERT_EQ(d.job(a).state, JobState::Running) << d.job(a).waiting_for;
  // Gang B (2 × 24 MiB) fits device 0 but not device 1 (8 MiB left): it
  // waits without a replica anywhere, so it holds no agent and no memory.
  const uint64_t b = submit(24, 2);
  EXPECT_EQ(d.job(b).state, JobState::Queued);
  EXPECT_EQ(busy_agents(), 2u) << "gang B took an agent while waiting";
  EXPECT_EQ(d.job(b).attempts.size(), 0u);
  EXPECT_NE(d.job(b).waiting_for.find("waiting for"), std::string::npos) << d.job(b).waiting_for;
  // A one-device job behind it would fit device 0, but device 0 is held
  // for gang B, first in line: it waits too (no starvation of gangs).
  uint64_t single = 0;
  d.submit(single, [](proto::JobSpecT& s) { s.memory_budget = "8MiB"; });
  EXPECT_EQ(d.job(single).state, JobState::Queued);
  EXPECT_EQ(job_on(w0b), 0u);
  // Device 1's memory comes back: gang B starts on both devices at once.
  d.release(l1, lease);
  d.heartbeat(w0b, {});
  EXPECT_EQ(d.job(b).state, JobState::Running) << d.job(b).waiting_for;
  EXPECT_EQ(job_on(w0b), b);
  EXPECT_EQ(job_on(w1b), b);
  EXPECT_EQ(d.job(single).state, JobState::Queued) << "no idle agent is left";
  // Gang A ends: the single job takes one of its agents. Nothing deadlocked.
  d.heartbeat(w0, {{a, 1, proto::JobPhase::Running}});
  d.heartbeat(w1, {{a, 1, proto::JobPhase::Running}});
  d.update(w1, a, 1, "succeeded");
  d.update(w0, a, 1, "succeeded");
  d.heartbeat(w0, {});
  d.heartbeat(w1, {});
  EXPECT_EQ(d.job(a).state, JobState::Succeeded);
  EXPECT_EQ(d.job(single).state, JobState::Running);
}

TEST_F(GangsTest, TwoGangsOnTwoDevicesTakeTurnsWithoutDeadlock) {
  // One worker per device and two 2-replica gangs: the second waits whole
  // for the first to end, then runs; neither ever holds one device alone.
  FakeAgent w0 = worker("w0", 100, 0), w1 = worker("w1", 101, 1);
  const uint64_t a = submit(16, 2), b = submit(16, 2);
  EXPECT_EQ(d.job(a).state, JobState::Running);
  EXPECT_EQ(d.job(b).state, JobState::Queued);
  for (const FakeAgent* w : {&w0, &w1}) d.heartbeat(*w, {{a, 1, proto::JobPhase::Running}});
  d.update(w1, a, 1, "succeeded");
  d.heartbeat(w1, {{a, 1, proto::JobPhase::Reporting}});
  EXPECT_EQ(d.job(b).state, JobState::Queued) << "w1 is free, but b needs both devices";
  EXPECT_EQ(job_on(w1), a) << "rank 1 stays the gang's until the gang ends";
  d.update(w0, a, 1, "succeeded");
  d.heartbeat(w0, {});
  d.heartbeat(w1, {});
  EXPECT_EQ(d.job(b).state, JobState::Running);
  EXPECT_EQ(job_on(w0), b);
  EXPECT_EQ(job_on(w1), b);
}

TEST_F(GangsTest, AReplicaLostStopsTheGangAndRequeuesItAsOneAttempt) {
  FakeAgent w0 = worker("w0", 100, 0), w1 = worker("w1", 101, 1);
  const uint64_t job = submit(8, 2);
  for (const FakeAgent* w : {&w0, &w1}) d.heartbeat(*w, {{job, 1, proto::JobPhase::Running}});
  // Rank 1's agent dies.
  d.gone.insert(101);
  Effects e = d.tick();
  EXPECT_EQ(d.job(job).state, JobState::Queued);
  EXPECT_EQ(d.job(job).agent_failures, 1u);
  const auto* stop = stop_of(e, w0, job);
  ASSERT_NE(stop, nullptr) << "rank 0 was not told to stop";
  EXPECT_FALSE(stop->cancel);
  EXPECT_NE(stop->reason.find("gang"), std::string::npos) << stop->reason;
  EXPECT_NE(d.job(job).reason.find("replica 1"), std::string::npos) << d.job(job).reason;
  ASSERT_EQ(d.job(job).attempts.size(), 1u);
  EXPECT_EQ(d.job(job).attempts[0].outcome, "agent lost");
  // While rank 0 still reports it running, it is not started again.
  FakeAgent w1b = worker("w1b", 102, 1);
  d.heartbeat(w0, {{job, 1, proto::JobPhase::Running}});
  EXPECT_EQ(d.job(job).state, JobState::Queued);
  // Rank 0 stops and reports: the gang starts again, as attempt 2.
  d.update(w0, job, 1, "interrupted");
  d.heartbeat(w0, {});
  EXPECT_EQ(d.job(job).state, JobState::Running);
  EXPECT_EQ(d.job(job).attempt_number(), 2u);
  EXPECT_EQ(job_on(w0), job);
  EXPECT_EQ(job_on(w1b), job);
}

TEST_F(GangsTest, CancelStopsEveryReplicaAndAFailedReplicaFailsTheJob) {
  FakeAgent w0 = worker("w0", 100, 0), w1 = worker("w1", 101, 1);
  const uint64_t job = submit(8, 2);
  for (const FakeAgent* w : {&w0, &w1}) d.heartbeat(*w, {{job, 1, proto::JobPhase::Running}});
  Effects e = d.cancel(job);
  ASSERT_NE(stop_of(e, w0, job), nullptr);
  ASSERT_NE(stop_of(e, w1, job), nullptr);
  EXPECT_TRUE(stop_of(e, w1, job)->cancel);
  d.update(w1, job, 1, "cancelled");
  d.update(w0, job, 1, "cancelled");
  EXPECT_EQ(d.job(job).state, JobState::Cancelled);
  d.heartbeat(w0, {});
  d.heartbeat(w1, {});

  const uint64_t next = submit(8, 2);
  for (const FakeAgent* w : {&w0, &w1}) d.heartbeat(*w, {{next, 1, proto::JobPhase::Running}});
  e = d.update(w1, next, 1, "failed", "out of memory in backward");
  EXPECT_EQ(d.job(next).state, JobState::Failed);
  EXPECT_NE(d.job(next).reason.find("replica 1 on agent 'w1' failed: out of memory"),
            std::string::npos)
      << d.job(next).reason;
  EXPECT_NE(stop_of(e, w0, next), nullptr) << "rank 0 keeps running a failed job";
}

TEST_F(GangsTest, SubmitRefusesMoreReplicasThanDevicesAndAPinnedGang) {
  for (auto [replicas, device, want] :
       {std::tuple{3, "auto", "serves 2"}, std::tuple{2, "cpu:1", "one device"},
        std::tuple{0, "auto", "not in [1, 64]"}, std::tuple{65, "auto", "not in [1, 64]"}}) {
    Effects e = d.request("client", "client", {}, proto::Body::SubmitJob, [&](auto& fbb) {
      proto::JobSpecT spec = CoreDriver::small_job("wide");
      spec.replicas = replicas;
      spec.device = device;
      return proto::CreateSubmitJob(fbb, proto::JobSpec::Pack(fbb, &spec)).Union();
    });
    const std::string why = errors(e);
    EXPECT_NE(why.find(want), std::string::npos) << replicas << " " << device << ": " << why;
  }
  EXPECT_TRUE(d.core().jobs().all().empty());
}

TEST_F(GangsTest, ACoordinatorRestartRequeuesARunningGangAndStopsItsReplicas) {
  FakeAgent w0 = worker("w0", 100, 0), w1 = worker("w1", 101, 1);
  const uint64_t job = submit(8, 2);
  for (const FakeAgent* w : {&w0, &w1}) d.heartbeat(*w, {{job, 1, proto::JobPhase::Running}});
  CoreDriver after(job_options(), std::vector<uint64_t>{64 * MiB, 64 * MiB},
                   std::make_unique<OccupancyPolicy>(OccupancyOptions{}));
  Effects e;
  after.core().recover(stored_rows(d), 0, after.now(), e);
  EXPECT_EQ(after.job(job).state, JobState::Queued);
  EXPECT_NE(after.job(job).reason.find("restarted"), std::string::npos) << after.job(job).reason;
  // Its old replicas come back still running it: told to stop, and the
  // gang waits for them before starting again.
  Effects reg;
  FakeAgent r0 = after.register_agent("w0", 100, {{job, 1, proto::JobPhase::Running}}, &reg, true, 0);
  EXPECT_TRUE(stops(reg, r0, job));
  FakeAgent r1 = after.register_agent("w1", 101, {{job, 1, proto::JobPhase::Running}}, &reg, true, 1);
  EXPECT_TRUE(stops(reg, r1, job));
  EXPECT_EQ(after.job(job).state, JobState::Queued);
  after.heartbeat(r0, {});
  after.heartbeat(r1, {});
  EXPECT_EQ(after.job(job).state, JobState::Running);
  EXPECT_EQ(after.job(job).attempt_number(), 2u);
}

TEST_F(GangsTest, EveryUnacknowledgedReplicaGetsItsAssignmentAgain) {
  FakeAgent w0 = worker("w0", 100, 0), w1 = worker("w1", 101, 1);
  const uint64_t job = submit(8, 2);
  // Neither push arrived: one heartbeat interval later both are sent again,
  // not only the first agent's (the resend clock is the job's).
  d.advance(std::chrono::milliseconds(1100));
  Effects e = d.tick();
  EXPECT_EQ(assigned(e, w0).size(), 1u);
  EXPECT_EQ(assigned(e, w1).size(), 1u);
  // w0 acknowledges; w1 still does not: only w1 gets it again.
  d.heartbeat(w0, {{job, 1, proto::JobPhase::Running}});
  d.advance(std::chrono::milliseconds(1100));
  e = d.tick();
  EXPECT_EQ(assigned(e, w0).size(), 0u);
  EXPECT_EQ(assigned(e, w1).size(), 1u);
}

TEST_F(GangsTest, AReplicaThatFinishedMayLeaveWhileRankZeroEnds) {
  FakeAgent w0 = worker("w0", 100, 0), w1 = worker("w1", 101, 1);
  const uint64_t job = submit(8, 2);
  for (const FakeAgent* w : {&w0, &w1}) d.heartbeat(*w, {{job, 1, proto::JobPhase::Running}});
  d.update(w1, job, 1, "succeeded");
  d.gone.insert(101);  // its agent exits after reporting
  d.tick();
  EXPECT_EQ(d.job(job).state, JobState::Running) << d.job(job).reason;
  EXPECT_EQ(d.job(job).agent_failures, 0u);
  d.update(w0, job, 1, "succeeded");
  EXPECT_EQ(d.job(job).state, JobState::Succeeded);
}

TEST_F(GangsTest, AReplicaLosingTheOthersRequeuesTheGangAndCounts) {
  FakeAgent w0 = worker("w0", 100, 0), w1 = worker("w1", 101, 1);
  uint64_t job = 0;
  d.submit(job, [](proto::JobSpecT& s) {
    s.memory_budget = "8MiB";
    s.replicas = 2;
    s.max_attempts = 1;
  });
  auto lost = [&](const FakeAgent& a, uint32_t attempt) {
    return d.request(a.rid, a.name, a.session, proto::Body::JobUpdate, [&](auto& fbb) {
      proto::JobUpdateT u;
      u.job_id = job;
      u.attempt = attempt;
      u.status = proto::JobStatus::Interrupted;
      u.reason = "the replicas' rendezvous did not answer";
      u.replica_lost = true;
      return proto::JobUpdate::Pack(fbb, &u).Union();
    });
  };
  // A gang that cannot connect is retried within max_attempts, then fails.
  for (uint32_t attempt = 1; attempt <= 2; ++attempt) {
    for (const FakeAgent* w : {&w0, &w1}) {
      d.heartbeat(*w, {{job, attempt, proto::JobPhase::Running}});
    }
    Effects e = lost(w1, attempt);
    EXPECT_TRUE(stops(e, w0, job));
    d.update(w0, job, attempt, "interrupted");
    d.heartbeat(w0, {});
    d.heartbeat(w1, {});
  }
  EXPECT_EQ(d.job(job).state, JobState::Failed);
  EXPECT_EQ(d.job(job).interruptions.at("replica_lost"), 2u);
  EXPECT_NE(d.job(job).reason.find("gave up after 2 attempts"), std::string::npos)
      << d.job(job).reason;
}

TEST(GangsOfDifferentSizes, AGangThatFitsTooFewDevicesHoldsNoneOfThem) {
  CoreDriver d(job_options(), std::vector<uint64_t>{32 * MiB, 128 * MiB},
               std::make_unique<OccupancyPolicy>(OccupancyOptions{}));
  FakeAgent w0 = d.register_agent("w0", 100, {}, nullptr, true, 0);
  FakeAgent w1 = d.register_agent("w1", 101, {}, nullptr, true, 1);
  uint64_t gang = 0, single = 0;
  d.submit(gang, [](proto::JobSpecT& s) {
    s.memory_budget = "64MiB";  // only device 1 holds it
    s.replicas = 2;
  });
  d.submit(single, [](proto::JobSpecT& s) { s.memory_budget = "8MiB"; });
  EXPECT_EQ(d.job(gang).state, JobState::Queued);
  EXPECT_NE(d.job(gang).waiting_for.find("1 of this coordinator's do"), std::string::npos)
      << d.job(gang).waiting_for;
  EXPECT_EQ(d.job(single).state, JobState::Running) << "the gang held a device it cannot use";
}

}  // namespace
}  // namespace leasehold::testing
