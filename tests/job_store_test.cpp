// The durable job store against real SQLite files in a temporary
// directory. Commits are made to fail by a second connection that holds the
// file's write lock (works as root, unlike chmod) or by a trigger that aborts
// one insert half-way through a transaction.
#include "coordinator/job_store.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>

#include "tests/support/store_fixture.h"

namespace leasehold::testing {
namespace {

TEST_F(JobStoreTest, NewStoreIsEmpty) {
  auto c = reload();
  EXPECT_TRUE(c.jobs.empty());
  EXPECT_EQ(c.next_id, 1u);
}

TEST_F(JobStoreTest, RoundTripKeepsBytesStatesAndOrder) {
  std::vector<uint8_t> binary = {0, 1, 0xff, 0, 0x80, 42};
  {
    auto store = JobStore::open(path_);
    auto r = store->commit({job(3, "third", "succeeded", 1700000000123), job(1, ""),
                            StoredJob{2, "running", 0, binary}},
                           {}, 4);
    ASSERT_TRUE(r.ok) << r.error;
  }
  auto c = reload();
  ASSERT_EQ(c.jobs.size(), 3u);
  EXPECT_EQ(c.jobs[0].id, 1u);
  EXPECT_EQ(c.jobs[0].state, "queued");
  EXPECT_TRUE(c.jobs[0].record.empty());
  EXPECT_EQ(c.jobs[1].id, 2u);
  EXPECT_EQ(c.jobs[1].state, "running");
  EXPECT_EQ(c.jobs[1].record, binary);
  EXPECT_EQ(c.jobs[1].finished_ms, 0u);
  EXPECT_EQ(c.jobs[2].id, 3u);
  EXPECT_EQ(c.jobs[2].state, "succeeded");
  EXPECT_EQ(c.jobs[2].finished_ms, 1700000000123u);
  EXPECT_EQ(c.jobs[2].record, bytes("third"));
  EXPECT_EQ(c.next_id, 4u);
}

TEST_F(JobStoreTest, UsesWalJournal) {
  auto store = JobStore::open(path_);
  Conn other(path_);
  EXPECT_EQ(other.text("PRAGMA journal_mode"), "wal");
}

// Every local user could read every job in a store that followed the
// umask: it is its owner's alone, its WAL too, whatever the umask says; a
// store made readable by an older version is narrowed.
TEST_F(JobStoreTest, TheStoreIsReadableByItsOwnerOnlyWhateverTheUmask) {
  const mode_t before = ::umask(0);
  {
    auto store = JobStore::open(path_);
    ASSERT_TRUE(store->commit({job(1, "a")}, {}, 2).ok);
    for (const std::string& f : {path_, path_ + "-wal"}) {
      struct stat st {};
      ASSERT_EQ(::stat(f.c_str(), &st), 0) << f;
      EXPECT_EQ(st.st_mode & 0777, 0600u) << f;
    }
  }
  ::umask(before);
  ASSERT_EQ(::chmod(path_.c_str(), 0644), 0);
  auto store = JobStore::open(path_);
  struct stat st {};
  ASSERT_EQ(::stat(path_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
}

TEST_F(JobStoreTest, IdsAreNeverReused) {
  {
    auto store = JobStore::open(path_);
    ASSERT_TRUE(
        store->commit({job(1, "a"), job(2, "b"), job(3, "c"), job(4, "d"), job(5, "e")}, {}, 6).ok);
    ASSERT_TRUE(store->commit({}, {1, 2, 3, 4, 5}, 1).ok);
  }
  auto c = reload();
  EXPECT_TRUE(c.jobs.empty());
  EXPECT_EQ(c.next_id, 6u);

  auto store = JobStore::open(path_);
  ASSERT_TRUE(store->commit({}, {}, 3).ok);
  EXPECT_EQ(store->load().next_id, 6u);
  // A put beyond next_id raises it, so deleting that job later frees nothing.
  ASSERT_TRUE(store->commit({job(10, "x")}, {}, 1).ok);
  ASSERT_TRUE(store->commit({}, {10}, 1).ok);
  EXPECT_EQ(store->load().next_id, 11u);
}

TEST_F(JobStoreTest, UpsertReplacesAndDeleteRemoves) {
  auto store = JobStore::open(path_);
  ASSERT_TRUE(store->commit({job(1, "v1"), job(2, "two"), job(3, "three")}, {}, 4).ok);
  ASSERT_TRUE(store->commit({job(1, "v2", "failed", 99)}, {2}, 4).ok);
  // Within one commit deletes apply after puts.
  ASSERT_TRUE(store->commit({job(3, "three again")}, {3}, 4).ok);
  auto c = store->load();
  ASSERT_EQ(c.jobs.size(), 1u);
  EXPECT_EQ(c.jobs[0].id, 1u);
  EXPECT_EQ(c.jobs[0].record, bytes("v2"));
  EXPECT_EQ(c.jobs[0].state, "failed");
  EXPECT_EQ(c.jobs[0].finished_ms, 99u);
}

// Checks the seeded contents of the failing-commit tests are untouched.
void expect_unchanged(const JobStore::Contents& c) {
  ASSERT_EQ(c.jobs.size(), 2u);
  EXPECT_EQ(c.jobs[0].record, bytes("v1"));
  EXPECT_EQ(c.jobs[1].id, 2u);
  EXPECT_EQ(c.next_id, 3u);
}

TEST_F(JobStoreTest, LockedCommitFailsNamingTheFileAndChangesNothing) {
  seed({job(1, "v1"), job(2, "two")}, 3);
  auto store = JobStore::open(path_);
  WriteLock lock(path_);
  auto r = store->commit({job(1, "v2"), job(5, "five")}, {2}, 10);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(contains(r.error, path_)) << r.error;
  EXPECT_TRUE(contains(r.error, "locked")) << r.error;
  lock.release();
  expect_unchanged(store->load());

  r = store->commit({job(1, "v2"), job(5, "five")}, {2}, 10);
  ASSERT_TRUE(r.ok) << r.error;
  auto c = reload();
  ASSERT_EQ(c.jobs.size(), 2u);
  EXPECT_EQ(c.jobs[0].record, bytes("v2"));
  EXPECT_EQ(c.jobs[1].id, 5u);
  EXPECT_EQ(c.next_id, 10u);
}

TEST_F(JobStoreTest, FailureHalfWayRollsBackTheWholeCommit) {
  seed({job(1, "v1"), job(2, "two")}, 3);
  auto store = JobStore::open(path_);
  Conn other(path_);
  other.exec(
      "CREATE TRIGGER fail_99 BEFORE INSERT ON jobs WHEN NEW.id = 99 "
      "BEGIN SELECT RAISE(ABORT, 'injected failure'); END");
  // Job 1's update and job 5's insert run before job 99 aborts.
  auto r = store->commit({job(1, "v2"), job(5, "five"), job(99, "boom")}, {2}, 200);
  EXPECT_FALSE(r.ok);
  EXPECT_TRUE(contains(r.error, path_)) << r.error;
  EXPECT_TRUE(contains(r.error, "injected failure")) << r.error;
  expect_unchanged(store->load());
  expect_unchanged(reload());

  other.exec("DROP TRIGGER fail_99");
  r = store->commit({job(1, "v2"), job(5, "five"), job(99, "boom")}, {2}, 200);
  ASSERT_TRUE(r.ok) << r.error;
  auto c = reload();
  ASSERT_EQ(c.jobs.size(), 3u);
  EXPECT_EQ(c.next_id, 200u);
}

TEST_F(JobStoreTest, GarbageFileIsRejectedAndLeftAlone) {
  std::string garbage;
  for (int i = 0; i < 512; ++i) garbage += "not an sqlite file ";
  std::ofstream(path_, std::ios::binary) << garbage;
  std::string error = open_error(path_);
  EXPECT_TRUE(contains(error, path_)) << error;
  std::ifstream in(path_, std::ios::binary);
  std::string after((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(after, garbage);
}

TEST_F(JobStoreTest, OtherApplicationsDatabaseIsRejected) {
  {
    Conn other(path_);
    other.exec("CREATE TABLE foo (x INTEGER); INSERT INTO foo VALUES (1)");
  }
  std::string error = open_error(path_);
  EXPECT_TRUE(contains(error, path_)) << error;
  EXPECT_TRUE(contains(error, "not a Leasehold job store")) << error;
  EXPECT_EQ(Conn(path_).text("SELECT count(*) FROM foo"), "1");
}

TEST_F(JobStoreTest, ForeignApplicationIdIsRejected) {
  Conn(path_).exec("PRAGMA application_id = 1234");
  std::string error = open_error(path_);
  EXPECT_TRUE(contains(error, path_)) << error;
  EXPECT_TRUE(contains(error, "not a Leasehold job store")) << error;
}

// Writes a store of about 700 kB and returns its size.
uintmax_t write_big_store(const std::string& path) {
  {
    auto store = JobStore::open(path);
    std::vector<StoredJob> jobs;
    for (uint64_t id = 1; id <= 2000; ++id) jobs.push_back(job(id, std::string(300, 'x')));
    EXPECT_TRUE(store->commit(jobs, {}, 2001).ok);
  }
  // Closing the last connection checkpoints the WAL into the main file.
  EXPECT_FALSE(fs::exists(path + "-wal"));
  return fs::file_size(path);
}

TEST_F(JobStoreTest, TruncatedStoreIsAnErrorNotAnEmptyQueue) {
  auto size = write_big_store(path_);
  ASSERT_GT(size, 600'000u);
  fs::resize_file(path_, size / 2);
  std::string error = open_error(path_);
  EXPECT_TRUE(contains(error, path_)) << error;
}

TEST_F(JobStoreTest, DamagedPageFailsTheCheckAtOpen) {
  auto size = write_big_store(path_);
  ASSERT_GT(size, 600'000u);
  {
    std::fstream f(path_, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(static_cast<std::streamoff>(size / 2 / 4096 * 4096));  // a whole page mid-file
    std::string junk(4096, '\xaa');
    f.write(junk.data(), static_cast<std::streamsize>(junk.size()));
    ASSERT_TRUE(f.good());
  }
  try {
    JobStore::open(path_);  // not load(): quick_check must catch it before any read
    ADD_FAILURE() << "open accepted a damaged store";
  } catch (const JobStoreError& e) {
    EXPECT_TRUE(contains(e.what(), path_)) << e.what();
    EXPECT_TRUE(contains(e.what(), "integrity check")) << e.what();
  }
}

TEST_F(JobStoreTest, DirectoryIsRejected) {
  std::string error = open_error(dir_);
  EXPECT_TRUE(contains(error, dir_)) << error;
  EXPECT_TRUE(contains(error, "directory")) << error;
}

TEST_F(JobStoreTest, MissingParentDirectoryIsRejected) {
  std::string path = dir_ + "/missing/jobs.db";
  std::string error = open_error(path);
  EXPECT_TRUE(contains(error, path)) << error;
}

TEST_F(JobStoreTest, NewerSchemaVersionIsRejected) {
  seed({job(1, "v1")}, 2);
  Conn(path_).exec("PRAGMA user_version = 2");
  std::string error = open_error(path_);
  EXPECT_TRUE(contains(error, path_)) << error;
  EXPECT_TRUE(contains(error, "newer")) << error;
}

}  // namespace
}  // namespace leasehold::testing
