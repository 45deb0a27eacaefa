// The coordinator's core with a fake clock: jobs. Scheduling order,
// acknowledged assignment and stop, the races the protocol must survive,
// lost agents, restarts and retention. (What a hostile or careless peer
// can do to jobs is in core_trust_test.cpp.)
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

TEST(CoreJobs, SubmissionIsAcknowledgedWithItsStoreWriteAndIdsIncrease) {
  CoreDriver d(job_options());
  uint64_t id1 = 0, id2 = 0;
  Effects e1 = d.submit(id1);
  EXPECT_TRUE(e1.writes_store()) << "the acknowledgement waits for the job's row";
  EXPECT_TRUE(e1.store_puts.count(id1));
  d.submit(id2);
  EXPECT_EQ(id1, 1u);
  EXPECT_EQ(id2, 2u);
  const JobRecord& j = d.job(id1);
  EXPECT_EQ(j.state, JobState::Queued);
  EXPECT_EQ(j.checkpoint, "/var/lib/leasehold-test/checkpoints/1/job1.ckpt")
      << "checkpoints are on by default, in a folder of the job's own";
  uint64_t id3 = 0;
  d.submit(id3, [](proto::JobSpecT& s) {
    s.checkpoint = std::make_unique<proto::CheckpointSpecT>();
    s.checkpoint->enabled = false;
  });
  EXPECT_EQ(d.job(id3).checkpoint, "");
}

TEST(CoreJobs, BadSubmissionsAreRefusedAndQueueNothing) {
  CoreDriver d(job_options());
  auto submit_raw = [&](const proto::JobSpecT& spec) {
    return d.request("client", "client", {}, proto::Body::SubmitJob, [&](auto& fbb) {
      return proto::CreateSubmitJob(fbb, proto::JobSpec::Pack(fbb, &spec)).Union();
    });
  };
  auto spec = CoreDriver::small_job("bad");
  spec.epochs = -1;
  Effects e = submit_raw(spec);
  EXPECT_NE(errors(e).find("epochs"), std::string::npos) << errors(e);
  EXPECT_TRUE(e.file_checks.empty());

  // Files are checked off the loop; their problems come back as the reply.
  Effects ok = submit_raw(CoreDriver::small_job("nofile"));
  ASSERT_EQ(ok.file_checks.size(), 1u);
  Effects done;
  d.core().file_check_done(ok.file_checks[0].token,
                           {"dataset.train_images: /data/train-images is not a regular file"},
                           d.now(), done);
  EXPECT_NE(errors(done).find("not a regular file"), std::string::npos) << errors(done);

  // A check that never finishes (a hung file system) times out, and its
  // late result is ignored.
  Effects hung = submit_raw(CoreDriver::small_job("hung"));
  ASSERT_EQ(hung.file_checks.size(), 1u);
  EXPECT_TRUE(d.core().next_deadline().has_value());
  d.advance(10001ms);
  Effects expired = d.tick();
  EXPECT_NE(errors(expired).find("took longer than"), std::string::npos) << errors(expired);
  Effects late;
  d.core().file_check_done(hung.file_checks[0].token, {}, d.now(), late);
  EXPECT_TRUE(late.messages.empty());

  // While the store cannot commit, nothing is accepted.
  d.core().set_store_error("database or disk is full");
  Effects refused = submit_raw(CoreDriver::small_job("full"));
  EXPECT_NE(errors(refused).find("database or disk is full"), std::string::npos);
  EXPECT_TRUE(d.core().jobs().all().empty());
}

TEST(CoreJobs, QueuedJobsStartByPriorityThenSubmissionOnIdleAgents) {
  CoreDriver d(job_options());
  uint64_t low = 0, high = 0, low2 = 0;
  d.submit(low);
  d.submit(high, [](proto::JobSpecT& s) { s.priority = 5; });
  d.submit(low2);
  FakeAgent a = d.register_agent("a", 11);
  FakeAgent b;
  Effects eb;
  b = d.register_agent("b", 12, {}, &eb);
  // a registered first and took the most urgent job; b the next one.
  EXPECT_EQ(d.job(high).agent, "a");
  EXPECT_EQ(d.job(high).state, JobState::Running);
  EXPECT_EQ(assigned(eb, b), (std::vector<std::pair<uint64_t, uint32_t>>{{low, 1}}));
  EXPECT_TRUE(eb.writes_store()) << "an assignment leaves once it is stored";
  EXPECT_EQ(d.job(low2).state, JobState::Queued);
}

TEST(CoreJobs, AssignmentIsResentUntilTheAgentsHeartbeatListsIt) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  Effects first = d.submit(id);
  ASSERT_EQ(assigned(first, a).size(), 1u);
  d.advance(500ms);
  EXPECT_TRUE(assigned(d.tick(), a).empty()) << "not within the interval";
  d.heartbeat(a);  // sent before the push arrived: lists nothing
  d.advance(600ms);
  EXPECT_EQ(assigned(d.tick(), a).size(), 1u) << "resent after an interval";
  d.heartbeat(a, {{id, 1, P::Queued}});
  EXPECT_TRUE(d.job(id).assign_acked);
  d.advance(5000ms);
  d.heartbeat(a, {{id, 1, P::Running}});
  EXPECT_TRUE(assigned(d.tick(), a).empty()) << "acknowledged: no more resends";
}

TEST(CoreJobs, PurgingSeveralDeadAgentsNeverAssignsToOneOfThem) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t j1 = 0;
  d.submit(j1);
  EXPECT_EQ(d.job(j1).agent, "a");
  FakeAgent b = d.register_agent("b", 12);  // idle
  d.heartbeat(a, {{j1, 1, P::Running}});
  d.heartbeat(b);
  d.gone = {11, 12};
  d.advance(2500ms);
  Effects e = d.tick();  // both dead: both dropped in this one turn
  EXPECT_TRUE(d.core().agents().empty());
  EXPECT_TRUE(messages(e, proto::Body::AssignJob).empty()) << "j1 went to b, which is dead too";
  EXPECT_EQ(d.job(j1).state, JobState::Queued);
  EXPECT_EQ(d.job(j1).attempts.size(), 1u) << "no attempt on a dead agent";
  EXPECT_EQ(d.job(j1).agent_failures, 1u);
}

TEST(CoreJobs, AJobWhoseAgentDiesResumesElsewhereFromItsCheckpoint) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  EXPECT_FALSE(d.update(a, id, 1, "running", "", 1, true).messages.empty());
  Effects ep2 = d.update(a, id, 1, "running", "", 2, true);
  EXPECT_TRUE(ep2.writes_store()) << "epoch reports are acknowledged once stored";
  EXPECT_EQ(messages(ep2, proto::Body::Ack, a.rid).size(), 1u);
  d.gone.insert(11);  // a is killed
  d.advance(2100ms);
  FakeAgent b = d.register_agent("b", 12);  // idle, but a is not purged yet
  d.advance(200ms);
  d.heartbeat(b);
  Effects purge = d.tick();
  const JobRecord& j = d.job(id);
  EXPECT_EQ(j.state, JobState::Running) << "requeued and taken by b in the same turn";
  EXPECT_EQ(j.agent, "b");
  EXPECT_EQ(assigned(purge, b), (std::vector<std::pair<uint64_t, uint32_t>>{{id, 2}}));
  ASSERT_EQ(j.attempts.size(), 2u);
  EXPECT_EQ(j.attempts[0].outcome, "agent lost");
  EXPECT_NE(j.attempts[0].reason.find("declared dead"), std::string::npos);
  EXPECT_EQ(states(j), (std::vector<std::string>{"queued", "running", "queued", "running"}));
  EXPECT_NE(j.history[2].reason.find("resuming from epoch 2"), std::string::npos)
      << j.history[2].reason;

  // b resumes from epoch 2: later epochs of attempt 1 would be replaced.
  d.update(b, id, 2, "running", "", 0, false, 2);
  EXPECT_EQ(d.job(id).attempts[1].resumed_from_epoch, 2);
  d.update(b, id, 2, "running", "", 3, true, 2);
  Effects done = d.update(b, id, 2, "succeeded", "", 0, false, 2);
  EXPECT_TRUE(done.writes_store()) << "the final result is acknowledged once stored";
  EXPECT_EQ(d.job(id).state, JobState::Succeeded);
  EXPECT_EQ(d.job(id).epochs.size(), 3u);
  EXPECT_EQ(d.job(id).reason, "");
}

TEST(CoreJobs, AfterMaxAttemptsLostAgentsTheJobFailsWithEveryReason) {
  CoreDriver d(job_options());
  uint64_t id = 0;
  d.submit(id, [](proto::JobSpecT& s) { s.max_attempts = 1; });
  for (int k = 0; k < 2; ++k) {
    FakeAgent a = d.register_agent("w" + std::to_string(k), 20 + k);
    ASSERT_EQ(d.job(id).agent, a.name);
    d.heartbeat(a, {{id, static_cast<uint32_t>(k + 1), P::Running}});
    d.gone.insert(20 + k);
    d.advance(2500ms);
    d.tick();
  }
  const JobRecord& j = d.job(id);
  EXPECT_EQ(j.state, JobState::Failed);
  EXPECT_EQ(j.attempts.size(), 2u);
  EXPECT_NE(j.reason.find("gave up after 2 attempts"), std::string::npos) << j.reason;
  EXPECT_NE(j.reason.find("agent 'w0'"), std::string::npos) << j.reason;
  EXPECT_NE(j.reason.find("agent 'w1'"), std::string::npos) << j.reason;
}

TEST(CoreJobs, ACancelBetweenAssignmentAndStartIsNotLost) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  // The assignment is on its way; the agent has not listed it yet.
  Effects c = d.cancel(id);
  EXPECT_TRUE(stops(c, a, id));
  EXPECT_TRUE(c.writes_store()) << "the cancel is stored before it is acknowledged";
  EXPECT_TRUE(d.job(id).cancel_requested);
  d.heartbeat(a);  // still nothing listed
  d.advance(1100ms);
  Effects t = d.tick();
  EXPECT_TRUE(stops(t, a, id)) << "StopJob is resent";
  EXPECT_TRUE(assigned(t, a).empty()) << "a cancelled assignment is not resent";
  // The agent got the stop before (or without) the assignment and says so.
  d.update(a, id, 1, "cancelled", "cancelled before it started");
  EXPECT_EQ(d.job(id).state, JobState::Cancelled);
  uint64_t next = 0;
  Effects e = d.submit(next);
  EXPECT_EQ(assigned(e, a).size(), 1u) << "the agent is free again";
}

TEST(CoreJobs, StopIsResentUntilTheAgentShowsItStopping) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(a, {{id, 1, P::Running}});
  EXPECT_TRUE(stops(d.cancel(id), a, id));
  d.advance(1100ms);
  d.heartbeat(a, {{id, 1, P::Running}});
  EXPECT_TRUE(stops(d.tick(), a, id));
  d.heartbeat(a, {{id, 1, P::Stopping}});
  d.advance(1100ms);
  EXPECT_FALSE(stops(d.tick(), a, id)) << "it is stopping";
  d.update(a, id, 1, "cancelled", "cancelled by request");
  EXPECT_EQ(d.job(id).state, JobState::Cancelled);
}

TEST(CoreJobs, AFinalReportSentTwiceIsAcknowledgedTwiceAfterItsWrite) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  d.update(a, id, 1, "succeeded");
  Effects again = d.update(a, id, 1, "succeeded");
  EXPECT_EQ(messages(again, proto::Body::Ack, a.rid).size(), 1u) << errors(again);
  EXPECT_TRUE(again.writes_store()) << "not acknowledged before the first one is stored";
  EXPECT_EQ(d.job(id).history.size(), 3u) << "applied once";
  // A report for an attempt that is not running on this agent is refused.
  Effects stale = d.update(a, id, 7, "running");
  EXPECT_NE(errors(stale).find("not running on agent 'a'"), std::string::npos) << errors(stale);
}

TEST(CoreJobs, AnAgentRunningAJobItWasNotGivenIsToldToStopAndTheJobWaits) {
  CoreDriver d(job_options());
  uint64_t id = 0;
  d.submit(id);
  // An agent that still runs job 1 from before (the coordinator requeued it).
  FakeAgent old;
  Effects reg;
  old = d.register_agent("old", 11, {{id, 9, P::Running}}, &reg);
  EXPECT_TRUE(stops(reg, old, id));
  FakeAgent fresh = d.register_agent("fresh", 12);
  EXPECT_EQ(d.job(id).state, JobState::Queued) << "not started twice";
  EXPECT_TRUE(d.core().agents().at("old").job_id == 0);
  Effects hb = d.heartbeat(old, {{id, 9, P::Stopping}});
  EXPECT_EQ(d.job(id).state, JobState::Queued) << "still stopping on 'old'";
  Effects free = d.heartbeat(old, {});
  EXPECT_EQ(d.job(id).state, JobState::Running);
  EXPECT_EQ(d.job(id).agent, "fresh") << "the first idle agent in name order once it is free";
  (void)hb;
  (void)fresh;
  (void)free;
}

// ---- Listing, retention ----

TEST(CoreJobs, FinishedJobsArePrunedByCountAndAgeWithTheirOwnCheckpointFolders) {
  CoreOptions o = job_options();
  o.retention_count = 3;
  o.retention_age = std::chrono::hours(24);
  CoreDriver d(o);
  std::vector<uint64_t> ids(6);
  for (auto& id : ids) d.submit(id);
  d.job(ids[5]);  // stays queued: never pruned
  for (int i = 0; i < 5; ++i) {
    d.cancel(ids[i]);
    d.advance(1000ms);
  }
  d.advance(61s);
  Effects e = d.tick();
  EXPECT_EQ(e.store_deletes, (std::vector<uint64_t>{ids[1], ids[0]})) << "the two oldest";
  EXPECT_EQ(e.remove_dirs.size(), 2u);
  EXPECT_EQ(e.remove_dirs[0], "/var/lib/leasehold-test/checkpoints/" + std::to_string(ids[1]));
  EXPECT_EQ(d.core().jobs().all().size(), 4u);
  d.advance(std::chrono::hours(25));
  Effects aged = d.tick();
  EXPECT_EQ(aged.store_deletes.size(), 3u) << "older than the retention age";
  EXPECT_EQ(d.core().jobs().all().size(), 1u);
  EXPECT_EQ(d.job(ids[5]).state, JobState::Queued);
  uint64_t next = 0;
  d.submit(next);
  EXPECT_EQ(next, 7u) << "ids of pruned jobs are not reused";
}

TEST(CoreJobs, StoredRowsRoundTripEverything) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id, [](proto::JobSpecT& s) { s.max_attempts = 7; });
  d.update(a, id, 1, "running", "", 1, true);
  d.cancel(id);
  const JobRecord& j = d.job(id);
  JobRecord back = decode_job(id, encode_job(j));
  EXPECT_EQ(back.name, j.name);
  EXPECT_EQ(back.state, j.state);
  EXPECT_EQ(back.max_attempts, 7);
  EXPECT_TRUE(back.cancel_requested);
  EXPECT_EQ(back.attempts.size(), 1u);
  EXPECT_EQ(back.attempts[0].agent, "a");
  EXPECT_EQ(back.epochs.size(), 1u);
  EXPECT_TRUE(back.epochs[0].checkpointed);
  EXPECT_EQ(back.checkpoint, j.checkpoint);
  EXPECT_EQ(back.history.size(), j.history.size());
  EXPECT_EQ(back.spec->max_attempts, 7);
  auto bytes = encode_job(j);
  bytes[bytes.size() / 2] ^= 0xff;
  bytes.resize(bytes.size() / 3);
  EXPECT_THROW(decode_job(id, bytes), std::runtime_error);
  EXPECT_THROW(decode_job(id + 1, encode_job(j)), std::runtime_error) << "the row of another job";
}

// A job stored before protocol version 6 kept its state, and its history's,
// as text: it reads back with statuses, which go out from then on.
TEST(CoreJobs, ARowStoredWithStatesAsTextReadsBack) {
  proto::JobInfoT old;
  old.id = 4;
  old.name = "old";
  old.state = "succeeded";
  old.spec = std::make_unique<proto::JobSpecT>(CoreDriver::small_job("old"));
  for (const char* s : {"queued", "running", "succeeded"}) {
    auto h = std::make_unique<proto::StateChangeT>();
    h->state = s;
    old.history.push_back(std::move(h));
  }
  flatbuffers::FlatBufferBuilder fbb;
  fbb.Finish(proto::JobInfo::Pack(fbb, &old));
  const std::vector<uint8_t> bytes(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
  JobRecord back = decode_job(4, bytes);
  EXPECT_EQ(back.state, JobState::Succeeded);
  ASSERT_EQ(back.history.size(), 3u);
  EXPECT_EQ(states(back), (std::vector<std::string>{"queued", "running", "succeeded"}));
  EXPECT_EQ(back.history[2].status, proto::JobStatus::Succeeded);
  EXPECT_TRUE(back.history[2].state.empty());
  // Written again, with its status.
  const auto again = encode_job(back);
  const auto* info = flatbuffers::GetRoot<proto::JobInfo>(again.data());
  EXPECT_EQ(info->status(), proto::JobStatus::Succeeded);
  // A text that names no state is refused, naming it.
  old.state = "finished";
  flatbuffers::FlatBufferBuilder bad;
  bad.Finish(proto::JobInfo::Pack(bad, &old));
  try {
    decode_job(4, std::vector<uint8_t>(bad.GetBufferPointer(), bad.GetBufferPointer() + bad.GetSize()));
    ADD_FAILURE() << "a row in state 'finished' was read";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("'finished'"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace leasehold::testing
