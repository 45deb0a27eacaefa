// Shared by the job store's tests: a temporary store file, a second SQLite
// connection to it (as another process would have), and a write lock that
// makes the store's commits fail ("database is locked").
#pragma once

#include <gtest/gtest.h>
#include <sqlite3.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/job_store.h"

namespace leasehold::testing {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

inline std::vector<uint8_t> bytes(const std::string& s) { return {s.begin(), s.end()}; }

inline StoredJob job(uint64_t id, const std::string& record, const std::string& state = "queued",
              uint64_t finished_ms = 0) {
  return StoredJob{id, state, finished_ms, bytes(record)};
}

inline bool contains(const std::string& text, const std::string& part) {
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
inline std::string open_error(const std::string& path) {
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
inline const StoredJob* find(const JobStore::Contents& c, uint64_t id) {
  for (const StoredJob& j : c.jobs)
    if (j.id == id) return &j;
  return nullptr;
}

}  // namespace leasehold::testing
