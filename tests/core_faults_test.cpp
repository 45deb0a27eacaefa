// The coordinator's core with a fake clock: device faults. Without MPS a
// fault is the job's own and counts; under MPS a fault shared by several
// jobs counts against none, and the jobs come back as suspects that run
// alone until they have run cleanly; a suspect that faults alone counts.
#include <gtest/gtest.h>

#include <algorithm>

#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
using P = proto::JobPhase;

CoreOptions mps_options() {
  CoreOptions o = job_options();
  o.mps_pipe_directory = "/run/leasehold/mps-pipe";
  o.fault_window = 5000ms;
  o.fault_probation = 30000ms;
  return o;
}

bool history_says(const JobRecord& j, const std::string& text) {
  return std::any_of(j.history.begin(), j.history.end(), [&](const proto::StateChangeT& h) {
    return h.reason.find(text) != std::string::npos;
  });
}

std::vector<uint64_t> running(CoreDriver& d) {
  std::vector<uint64_t> out;
  for (const auto& [id, job] : d.core().jobs().all()) {
    if (job.state == JobState::Running) out.push_back(id);
  }
  return out;
}

// Three agents, each running one of three jobs (acknowledged).
struct Three {
  CoreDriver d;
  FakeAgent a, b, c;
  uint64_t j1 = 0, j2 = 0, j3 = 0;
  explicit Three(CoreOptions o) : d(std::move(o)) {
    a = d.register_agent("a", 11);
    b = d.register_agent("b", 12);
    c = d.register_agent("c", 13);
    d.submit(j1);
    d.submit(j2);
    d.submit(j3);
    for (auto* agent : {&a, &b, &c}) {
      for (uint64_t id : {j1, j2, j3}) {
        if (d.job(id).agent == agent->name) d.heartbeat(*agent, {{id, 1, P::Running}});
      }
    }
  }
  FakeAgent& agent_of(uint64_t id) {
    const std::string& n = d.job(id).agent;
    return n == "a" ? a : n == "b" ? b : c;
  }
  // One MPS fault ends all three jobs; the agents restart (the same
  // processes, executed again) and register again, idle.
  void shared_fault_and_restart() {
    for (uint64_t id : {j1, j2, j3}) d.device_fault(agent_of(id), id, 1);
    a = d.register_agent("a", 11);
    b = d.register_agent("b", 12);
    c = d.register_agent("c", 13);
  }
  // Lets `seconds` pass, every agent heart-beating its running job.
  void pass(int seconds) {
    for (int i = 0; i < seconds; ++i) {
      d.advance(1000ms);
      for (auto* agent : {&a, &b, &c}) {
        std::vector<Listed> listed;
        for (const auto& [id, job] : d.core().jobs().all()) {
          if (job.state == JobState::Running && job.agent == agent->name) {
            listed.push_back({id, job.attempt_number(), P::Running});
          }
        }
        d.heartbeat(*agent, listed);
      }
      d.tick();
    }
  }
};

// The outcome of attempt `number` of `j`.
std::string outcome(const JobRecord& j, uint32_t number) {
  for (const auto& a : j.attempts) {
    if (a.number == number) return a.outcome;
  }
  return "(no attempt " + std::to_string(number) + ")";
}

TEST(CoreFaults, WithoutMpsADeviceFaultIsTheJobsOwnAndCounts) {
  Three t(job_options());
  ASSERT_EQ(running(t.d).size(), 3u);
  FakeAgent& ag = t.agent_of(t.j2);
  Effects e = t.d.device_fault(ag, t.j2, 1, "device fault on agent 'b': cudaErrorIllegalAddress");
  EXPECT_EQ(error_code(e, ag.rid), std::nullopt) << errors(e);
  const JobRecord& j = t.d.job(t.j2);
  EXPECT_EQ(j.state, JobState::Queued) << "its agent restarts before it takes a job";
  EXPECT_EQ(j.agent_failures, 1u) << "counted against max_attempts";
  EXPECT_EQ(j.attempts.front().outcome, "device fault");
  EXPECT_FALSE(j.fault_suspect);
  EXPECT_EQ(t.d.job(t.j1).state, JobState::Running) << "the others run on";
  EXPECT_EQ(t.d.job(t.j3).state, JobState::Running);
  EXPECT_EQ(t.d.core().device_faults(), 1u);
  ag = t.d.register_agent(ag.name, ag.pid);  // restarted
  EXPECT_EQ(t.d.job(t.j2).state, JobState::Running);
  EXPECT_EQ(t.d.job(t.j2).attempt_number(), 2u);
}

TEST(CoreFaults, UnderMpsAFaultSharedBySeveralJobsCountsAgainstNone) {
  Three t(mps_options());
  for (uint64_t id : {t.j2, t.j3, t.j1}) {  // reported in any order, within the window
    t.d.device_fault(t.agent_of(id), id, 1, "device fault: cudaErrorIllegalAddress");
    t.d.advance(300ms);
  }
  for (uint64_t id : {t.j1, t.j2, t.j3}) {
    const JobRecord& j = t.d.job(id);
    EXPECT_NE(j.state, JobState::Failed) << id;
    EXPECT_EQ(j.agent_failures, 0u) << "job " << id << ": not known to be its fault";
    EXPECT_TRUE(j.fault_suspect) << id;
    EXPECT_TRUE(history_says(j, "not counted")) << id;
    EXPECT_EQ(j.attempts.front().outcome, "interrupted") << id;
  }
}

TEST(CoreFaults, SuspectsRunAloneAndAFaultAloneIsTheirOwn) {
  Three t(mps_options());
  t.shared_fault_and_restart();
  t.d.tick();
  auto now_running = running(t.d);
  ASSERT_EQ(now_running.size(), 1u) << "one suspect at a time, alone";
  const uint64_t first = now_running[0];
  for (uint64_t id : {t.j1, t.j2, t.j3}) {
    if (id == first) continue;
    EXPECT_EQ(t.d.job(id).state, JobState::Queued);
    EXPECT_NE(t.d.job(id).waiting_for.find("alone"), std::string::npos)
        << t.d.job(id).waiting_for;
  }
  // It faults again while alone: its own fault, counted; it stays a suspect.
  uint32_t attempt = t.d.job(first).attempt_number();
  t.d.heartbeat(t.agent_of(first), {{first, attempt, P::Running}});
  t.pass(1);  // within the window, but a new attempt: a new fault
  t.d.device_fault(t.agent_of(first), first, attempt, "device fault: cudaErrorIllegalAddress");
  const JobRecord& culprit = t.d.job(first);
  EXPECT_EQ(culprit.agent_failures, 1u);
  EXPECT_EQ(outcome(culprit, attempt), "device fault");
  EXPECT_TRUE(history_says(culprit, "its own")) << culprit.reason;
  EXPECT_TRUE(culprit.fault_suspect) << "it runs alone next time too";
}

TEST(CoreFaults, SuspectsGoFirstOneAtATimeThenOthersRunBesideThem) {
  Three t(mps_options());
  t.shared_fault_and_restart();
  uint64_t extra = 0;
  t.d.submit(extra);  // not a suspect, but the GPU drains for the suspects first
  t.d.tick();
  auto r = running(t.d);
  ASSERT_EQ(r.size(), 1u);
  uint64_t first = r[0];
  EXPECT_EQ(t.d.job(extra).state, JobState::Queued);
  EXPECT_NE(t.d.job(extra).waiting_for.find("suspected of a device fault"), std::string::npos)
      << t.d.job(extra).waiting_for;

  // Probation runs from this attempt's first step: 30 s of training.
  uint32_t attempt = t.d.job(first).attempt_number();
  t.d.heartbeat(t.agent_of(first), {{first, attempt, P::Running}});
  t.pass(40);
  EXPECT_TRUE(t.d.job(first).fault_suspect) << "the clock starts at its first step";
  t.d.first_step(t.agent_of(first), first, attempt);
  t.pass(29);
  EXPECT_TRUE(t.d.job(first).fault_suspect);
  t.pass(2);
  EXPECT_FALSE(t.d.job(first).fault_suspect);
  EXPECT_EQ(running(t.d).size(), 1u) << "the other suspects wait to run alone, and others wait";
  // Each suspect in turn runs alone and is cleared by an epoch of its own.
  for (int turn = 0; turn < 2; ++turn) {
    t.d.update(t.agent_of(first), first, attempt, "succeeded");
    t.d.tick();
    r = running(t.d);
    ASSERT_EQ(r.size(), 1u) << turn;
    first = r[0];
    EXPECT_TRUE(t.d.job(first).fault_suspect);
    EXPECT_NE(first, extra);
    attempt = t.d.job(first).attempt_number();
    t.d.heartbeat(t.agent_of(first), {{first, attempt, P::Running}});
    t.d.first_step(t.agent_of(first), first, attempt);
    t.d.update(t.agent_of(first), first, attempt, "running", "", 1, true);
    EXPECT_FALSE(t.d.job(first).fault_suspect);
  }
  t.d.tick();
  EXPECT_EQ(t.d.job(extra).state, JobState::Running) << "no suspect left: it runs beside";
  EXPECT_EQ(running(t.d).size(), 2u);
}

TEST(CoreFaults, TheCheckpointedEpochAResumeReportsAgainDoesNotEndProbation) {
  Three t(mps_options());
  t.shared_fault_and_restart();
  t.d.tick();
  auto r = running(t.d);
  ASSERT_EQ(r.size(), 1u);
  const uint64_t first = r[0];
  const uint32_t attempt = t.d.job(first).attempt_number();
  FakeAgent& ag = t.agent_of(first);
  t.d.heartbeat(ag, {{first, attempt, P::Running}});
  // It resumes after epoch 2 and reports that epoch again before training.
  t.d.update(ag, first, attempt, "running", "", 2, true, 2);
  EXPECT_TRUE(t.d.job(first).fault_suspect) << "nothing of this attempt has run yet";
  t.d.first_step(ag, first, attempt);
  t.d.update(ag, first, attempt, "running", "", 2, true, 2);
  EXPECT_TRUE(t.d.job(first).fault_suspect) << "epoch 2 is the checkpoint's, not this run's";
  t.d.update(ag, first, attempt, "running", "", 3, true, 2);
  EXPECT_FALSE(t.d.job(first).fault_suspect);
}

TEST(CoreFaults, AnAgentThatDoesNotRestartTakesJobsAgainAfterTwiceTheWindow) {
  CoreDriver d(mps_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t j = 0;
  d.submit(j);
  FakeAgent b = d.register_agent("b", 12);  // its context was elsewhere: it never restarts
  d.heartbeat(a, {{j, 1, P::Running}});
  d.device_fault(a, j, 1);
  for (int i = 0; i < 9; ++i) {
    d.advance(1000ms);
    d.heartbeat(b);
    d.tick();
  }
  EXPECT_EQ(d.job(j).state, JobState::Queued);
  for (int i = 0; i < 2; ++i) {
    d.advance(1000ms);
    d.heartbeat(b);
    d.tick();
  }
  EXPECT_EQ(d.job(j).state, JobState::Running) << "b takes jobs again after 10 s";
  EXPECT_EQ(d.job(j).agent, "b");
}

TEST(CoreFaults, AnEpochReportEndsProbation) {
  Three t(mps_options());
  t.shared_fault_and_restart();
  t.d.tick();
  auto r = running(t.d);
  ASSERT_EQ(r.size(), 1u);
  const uint64_t first = r[0];
  uint32_t attempt = t.d.job(first).attempt_number();
  t.d.heartbeat(t.agent_of(first), {{first, attempt, P::Running}});
  t.d.first_step(t.agent_of(first), first, attempt);
  t.d.update(t.agent_of(first), first, attempt, "running", "", 1, true);
  EXPECT_FALSE(t.d.job(first).fault_suspect);
  // Its work done, the next suspect runs alone.
  t.d.update(t.agent_of(first), first, attempt, "succeeded");
  t.d.tick();
  EXPECT_EQ(running(t.d).size(), 1u);
}

TEST(CoreFaults, FaultsOnlyAfterTheWindowAreSeparate) {
  // Under MPS with one job running, a fault is that job's own.
  CoreDriver d(mps_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t j = 0;
  d.submit(j);
  d.heartbeat(a, {{j, 1, P::Running}});
  d.device_fault(a, j, 1);
  EXPECT_EQ(d.job(j).agent_failures, 1u);
  EXPECT_TRUE(history_says(d.job(j), "alone on the GPU"));
}

TEST(CoreFaults, UnderMpsEveryAgentRestartsBeforeItsNextJob) {
  CoreDriver d(mps_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t j = 0;
  d.submit(j);
  ASSERT_EQ(d.job(j).agent, "a");
  FakeAgent b = d.register_agent("b", 12);  // idle beside it
  d.heartbeat(a, {{j, 1, P::Running}});
  d.device_fault(a, j, 1);
  d.tick();
  EXPECT_EQ(d.job(j).state, JobState::Queued)
      << "b's context ended too: a job given to it would fail at once";
  Effects st = d.status();
  auto reply = messages(st, proto::Body::StatusReply);
  ASSERT_EQ(reply.size(), 1u);
  for (const auto& agent : reply[0]->body.AsStatusReply()->agents) {
    EXPECT_EQ(agent->state, proto::AgentState::Restarting) << agent->name;
  }
  b = d.register_agent("b", 12);  // restarted (same process) and registered afresh
  EXPECT_EQ(d.job(j).state, JobState::Running);
  EXPECT_EQ(d.job(j).agent, "b");
}

TEST(CoreFaults, RepeatedOwnFaultsFailTheJobNamingThem) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t j = 0;
  d.submit(j, [](proto::JobSpecT& s) { s.max_attempts = 1; });
  for (uint32_t attempt = 1; attempt <= 2; ++attempt) {
    ASSERT_EQ(d.job(j).state, JobState::Running) << attempt;
    d.heartbeat(a, {{j, attempt, P::Running}});
    d.device_fault(a, j, attempt, "device fault on agent 'a': cudaErrorIllegalAddress");
    a = d.register_agent("a", 11);  // restarted
  }
  const JobRecord& job = d.job(j);
  EXPECT_EQ(job.state, JobState::Failed);
  EXPECT_NE(job.reason.find("gave up after 2 attempts"), std::string::npos) << job.reason;
  EXPECT_NE(job.reason.find("cudaErrorIllegalAddress"), std::string::npos) << job.reason;
}

}  // namespace
}  // namespace leasehold::testing
