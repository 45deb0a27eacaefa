// The durable job store and its writer thread, against real SQLite files in a
// temporary directory. Commits are made to fail by a second connection that
// holds the file's write lock (works as root, unlike chmod) or by a trigger
// that aborts one insert half-way through a transaction.
#include "coordinator/job_store.h"

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/store_writer.h"

namespace leasehold {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

StoredJob job(uint64_t id, const std::string& record, const std::string& state = "queued",
              uint64_t finished_ms = 0) {
  return StoredJob{id, state, finished_ms, bytes(record)};
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Polls for up to 10 s: the tests share 2 busy cores, so no tight timings.
template <class Pred>
bool eventually(Pred pred) {
  auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(10ms);
  }
  return true;
}

// A second connection to a store file, as another process would have.
class Conn {
 public:
  explicit Conn(const std::string& path) {
    EXPECT_EQ(sqlite3_open(path.c_str(), &db_), SQLITE_OK) << path;
  }
  ~Conn() { sqlite3_close(db_); }
  Conn(const Conn&) = delete;
  Conn& operator=(const Conn&) = delete;

  void exec(const std::string& sql) {
    char* err = nullptr;
    EXPECT_EQ(sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err), SQLITE_OK)
        << sql << ": " << (err ? err : "");
    sqlite3_free(err);
  }
  std::string text(const std::string& sql) {
    std::string out;
    auto row = [](void* out, int, char** values, char**) {
      *static_cast<std::string*>(out) = values[0] ? values[0] : "";
      return 0;
    };
    EXPECT_EQ(sqlite3_exec(db_, sql.c_str(), row, &out, nullptr), SQLITE_OK) << sql;
    return out;
  }

 private:
  sqlite3* db_ = nullptr;
};

// Holds the store file's write lock until release() or destruction, so that
// the store's commits fail with "database is locked" after its busy timeout.
class WriteLock {
 public:
  explicit WriteLock(const std::string& path) : conn_(path) { conn_.exec("BEGIN IMMEDIATE"); }
  void release() {
    if (held_) conn_.exec("ROLLBACK");
    held_ = false;
  }
  ~WriteLock() { release(); }

 private:
  Conn conn_;
  bool held_ = true;
};

// Open (and load) must fail with a JobStoreError; returns its message, or ""
// when nothing was thrown.
std::string open_error(const std::string& path) {
  try {
    auto store = JobStore::open(path);
    store->load();
  } catch (const JobStoreError& e) {
    return e.what();
  }
  return "";
}

class JobStoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "leasehold-store-XXXXXX").string();
    ASSERT_NE(mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
    path_ = dir_ + "/jobs.db";
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  JobStore::Contents reload() { return JobStore::open(path_)->load(); }
  void seed(const std::vector<StoredJob>& jobs, uint64_t next_id) {
    ASSERT_TRUE(JobStore::open(path_)->commit(jobs, {}, next_id).ok);
  }

  std::string dir_, path_;
};

// Finds a job by id in loaded contents; nullptr when absent.
const StoredJob* find(const JobStore::Contents& c, uint64_t id) {
  for (const StoredJob& j : c.jobs)
    if (j.id == id) return &j;
  return nullptr;
}

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

// A notify callback that counts calls and, until opened, holds the writer
// thread inside its first call, so that the test can queue writes behind it.
class Gate {
 public:
  std::function<void()> callback() {
    return [this] {
      std::unique_lock lock(mu_);
      ++calls_;
      changed_.notify_all();
      changed_.wait(lock, [&] { return open_; });
    };
  }
  void open() {
    std::lock_guard lock(mu_);
    open_ = true;
    changed_.notify_all();
  }
  int calls() {
    std::lock_guard lock(mu_);
    return calls_;
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  bool open_ = false;
  int calls_ = 0;
};

using StoreWriterTest = JobStoreTest;

TEST_F(StoreWriterTest, SequenceNumbersCommitAndNotify) {
  std::atomic<int> notified{0};
  {
    StoreWriter writer(JobStore::open(path_), [&] { ++notified; });
    EXPECT_EQ(writer.write({job(1, "a")}, {}, 2), 1u);
    EXPECT_EQ(writer.write({job(2, "b")}, {}, 3), 2u);
    EXPECT_EQ(writer.write({job(3, "c")}, {}, 4), 3u);
    EXPECT_TRUE(eventually([&] { return writer.committed() == 3; }));
    EXPECT_TRUE(eventually([&] { return notified > 0; }));
    EXPECT_EQ(writer.error(), "");
  }
  auto c = reload();
  EXPECT_EQ(c.jobs.size(), 3u);
  EXPECT_EQ(c.next_id, 4u);
}

TEST_F(StoreWriterTest, QueuedWritesShareOneTransactionAndLaterOnesWin) {
  seed({job(2, "B"), job(3, "C")}, 4);
  Gate gate;
  {
    StoreWriter writer(JobStore::open(path_), gate.callback());
    writer.write({job(10, "X")}, {}, 11);
    ASSERT_TRUE(eventually([&] { return gate.calls() == 1; }));  // writer parked in notify
    writer.write({job(1, "A v1")}, {}, 0);
    writer.write({job(1, "A v2")}, {}, 0);
    writer.write({}, {2}, 0);               // delete B
    writer.write({}, {3}, 0);               // delete C ...
    writer.write({job(3, "C v3")}, {}, 0);  // ... then put it back
    writer.write({job(4, "D")}, {}, 0);     // put D ...
    writer.write({}, {4}, 0);               // ... then delete it
    writer.write({}, {}, 50);
    uint64_t last = writer.write({}, {}, 40);
    gate.open();
    EXPECT_TRUE(eventually([&] { return writer.committed() == last; }));
    EXPECT_TRUE(eventually([&] { return gate.calls() == 2; }));
  }
  EXPECT_EQ(gate.calls(), 2);  // one commit for X, one for everything queued behind it
  auto c = reload();
  ASSERT_EQ(c.jobs.size(), 3u);
  ASSERT_NE(find(c, 1), nullptr);
  EXPECT_EQ(find(c, 1)->record, bytes("A v2"));
  EXPECT_EQ(find(c, 2), nullptr);
  ASSERT_NE(find(c, 3), nullptr);
  EXPECT_EQ(find(c, 3)->record, bytes("C v3"));
  EXPECT_EQ(find(c, 4), nullptr);
  EXPECT_NE(find(c, 10), nullptr);
  EXPECT_EQ(c.next_id, 50u);
}

TEST_F(StoreWriterTest, DestructorCommitsWhatIsQueued) {
  {
    StoreWriter writer(JobStore::open(path_), nullptr);
    writer.write({job(1, "a")}, {}, 2);
  }
  EXPECT_EQ(reload().jobs.size(), 1u);
}

TEST_F(StoreWriterTest, DestructorDrainsWritesQueuedBehindACommit) {
  Gate gate;
  std::thread opener;
  {
    StoreWriter writer(JobStore::open(path_), gate.callback());
    writer.write({job(1, "a")}, {}, 2);
    ASSERT_TRUE(eventually([&] { return gate.calls() == 1; }));
    writer.write({job(2, "b")}, {}, 3);
    // Let the writer go only once the destructor has started waiting for it.
    opener = std::thread([&] {
      std::this_thread::sleep_for(200ms);
      gate.open();
    });
  }
  opener.join();
  auto c = reload();
  EXPECT_EQ(c.jobs.size(), 2u);
  EXPECT_EQ(c.next_id, 3u);
}

TEST_F(StoreWriterTest, FailingCommitsReportRetryAndRecover) {
  seed({}, 1);
  WriteLock lock(path_);
  std::atomic<int> notified{0};
  {
    StoreWriter writer(JobStore::open(path_), [&] { ++notified; });
    writer.write({job(1, "v1")}, {}, 2);
    // Most likely the first attempt is now waiting 1 s for the lock, so v2
    // arrives while v1 is in flight and must win when v1 is put back. (If the
    // machine is slow both share a batch; the test then still passes.)
    std::this_thread::sleep_for(300ms);
    uint64_t last = writer.write({job(1, "v2"), job(2, "b")}, {}, 3);
    ASSERT_TRUE(eventually([&] { return !writer.error().empty(); }));
    EXPECT_TRUE(contains(writer.error(), path_)) << writer.error();
    EXPECT_TRUE(contains(writer.error(), "locked")) << writer.error();
    // Another failed attempt, and still nothing reported durable.
    int attempts = notified;
    ASSERT_TRUE(eventually([&] { return notified > attempts; }));
    EXPECT_EQ(writer.committed(), 0u);
    EXPECT_FALSE(writer.error().empty());

    lock.release();
    EXPECT_TRUE(eventually([&] { return writer.committed() == last; }));
    EXPECT_EQ(writer.error(), "");
  }
  auto c = reload();
  ASSERT_EQ(c.jobs.size(), 2u);
  EXPECT_EQ(c.jobs[0].record, bytes("v2"));
  EXPECT_EQ(c.next_id, 3u);
}

TEST_F(StoreWriterTest, DestructorGivesUpAfterTheDrainTimeout) {
  seed({}, 1);
  WriteLock lock(path_);
  {
    StoreWriter writer(JobStore::open(path_), nullptr, 200ms);
    writer.write({job(7, "never")}, {}, 8);
    ASSERT_TRUE(eventually([&] { return !writer.error().empty(); }));
  }  // returns although the lock is still held (a hang fails through ctest's timeout)
  lock.release();
  auto c = reload();
  EXPECT_TRUE(c.jobs.empty());
  EXPECT_EQ(c.next_id, 1u);
}

}  // namespace
}  // namespace leasehold
