// Submissions that are retried (SubmitJob.key) and submissions the job store
// cannot commit: a submitter always gets an answer, and a retry never
// queues a job twice.
#include <gtest/gtest.h>

#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

// Sends a SubmitJob with `key` from socket `rid`; returns its effects.
Effects submit_keyed(CoreDriver& d, const std::string& rid, const std::string& key,
                     const std::string& name = "keyed") {
  proto::JobSpecT spec = CoreDriver::small_job(name);
  return d.request(rid, rid, {}, proto::Body::SubmitJob, [&](auto& fbb) {
    return proto::CreateSubmitJob(fbb, proto::JobSpec::Pack(fbb, &spec), fbb.CreateString(key))
        .Union();
  });
}

uint64_t accepted_id(const Effects& e, const std::string& rid) {
  auto m = messages(e, proto::Body::JobAccepted, rid);
  return m.empty() ? 0 : m[0]->body.AsJobAccepted()->job_id;
}

TEST(CoreSubmit, ARetriedSubmissionIsAnsweredWithTheSameJob) {
  CoreDriver d(job_options());
  Effects first = submit_keyed(d, "c1", "k-1");
  ASSERT_EQ(first.file_checks.size(), 1u);
  Effects checked;
  d.core().file_check_done(first.file_checks[0].token, {}, d.now(), checked);
  const uint64_t id = accepted_id(checked, "c1");
  ASSERT_NE(id, 0u);
  // The answer was lost; the client asks again with the same key.
  Effects again = submit_keyed(d, "c2", "k-1");
  EXPECT_TRUE(again.file_checks.empty()) << "not checked, nor queued, again";
  EXPECT_EQ(accepted_id(again, "c2"), id);
  EXPECT_TRUE(again.store_puts.count(id)) << "answered once its row is committed";
  auto m = messages(again, proto::Body::JobAccepted, "c2");
  ASSERT_EQ(m.size(), 1u);
  EXPECT_TRUE(m[0]->after_store);
  EXPECT_EQ(d.core().jobs().all().size(), 1u);
  // Another key is another job.
  Effects other = submit_keyed(d, "c3", "k-2");
  EXPECT_EQ(other.file_checks.size(), 1u);
}

TEST(CoreSubmit, ARetryWhileTheFilesAreCheckedIsAnsweredByThatCheck) {
  CoreDriver d(job_options());
  Effects first = submit_keyed(d, "c1", "k");
  Effects retry = submit_keyed(d, "c2", "k");
  EXPECT_TRUE(retry.file_checks.empty());
  EXPECT_TRUE(retry.messages.empty()) << "no answer yet: the check's result answers it";
  Effects checked;
  d.core().file_check_done(first.file_checks[0].token, {}, d.now(), checked);
  EXPECT_NE(accepted_id(checked, "c2"), 0u) << "the latest request of the submission";
  EXPECT_EQ(d.core().jobs().all().size(), 1u);
}

TEST(CoreSubmit, KeysAreEachSubmittersOwnAndMustBePlain) {
  CoreDriver d(job_options());
  uint64_t mine = 0;
  {
    Effects e = submit_keyed(d, "c1", "same");
    Effects c;
    d.core().file_check_done(e.file_checks[0].token, {}, d.now(), c);
    mine = accepted_id(c, "c1");
  }
  d.peer = Peer::local(2000, 2000, 77);
  Effects theirs = submit_keyed(d, "c2", "same");
  EXPECT_EQ(theirs.file_checks.size(), 1u) << "another user's key names another job";
  EXPECT_EQ(accepted_id(theirs, "c2"), 0u) << "never someone else's job " << mine;
  for (const std::string& bad : {std::string(65, 'a'), std::string("a b"), std::string("ü"),
                                std::string("a\nb")}) {
    Effects e = submit_keyed(d, "c3", bad);
    EXPECT_EQ(error_code(e, "c3"), ErrorCode::InvalidArgument) << bad;
  }
}

// The store fails with a submission accepted in memory but not committed:
// the job is withdrawn (its row deleted, its assignment never sent), and a
// retry after the store recovers queues it exactly once.
TEST(CoreSubmit, AWithdrawnSubmissionIsQueuedOnceWhenRetriedAfterTheStoreRecovers) {
  CoreDriver d(job_options());
  FakeAgent a = d.register_agent("a", 11);
  Effects e = submit_keyed(d, "c1", "k");
  Effects checked;
  d.core().file_check_done(e.file_checks[0].token, {}, d.now(), checked);
  const uint64_t id = accepted_id(checked, "c1");
  ASSERT_NE(id, 0u);
  EXPECT_FALSE(assigned(checked, a).empty()) << "assigned in the same call, held for the commit";
  for (const auto* m : messages(checked, proto::Body::AssignJob)) EXPECT_EQ(m->job, id);
  d.core().set_store_error("cannot commit /state/jobs.db: disk full");
  Effects withdrawn;
  EXPECT_TRUE(d.core().withdraw_submission(id, d.now(), withdrawn));
  EXPECT_EQ(d.core().jobs().find(id), nullptr);
  EXPECT_EQ(withdrawn.store_deletes, std::vector<uint64_t>{id});
  EXPECT_EQ(d.core().agents().at("a").job_id, 0u) << "free for the next job";
  EXPECT_FALSE(d.core().withdraw_submission(id, d.now(), withdrawn)) << "once";
  // While it fails nothing is accepted.
  Effects refused = submit_keyed(d, "c2", "k");
  EXPECT_EQ(error_code(refused, "c2"), ErrorCode::Unavailable);
  EXPECT_NE(errors(refused).find("disk full"), std::string::npos) << errors(refused);
  d.core().set_store_error("");
  Effects retry = submit_keyed(d, "c3", "k");
  ASSERT_EQ(retry.file_checks.size(), 1u) << "a new submission: the old one is gone";
  Effects done;
  d.core().file_check_done(retry.file_checks[0].token, {}, d.now(), done);
  EXPECT_NE(accepted_id(done, "c3"), 0u);
  EXPECT_EQ(d.core().jobs().all().size(), 1u);
}

}  // namespace
}  // namespace leasehold::testing
