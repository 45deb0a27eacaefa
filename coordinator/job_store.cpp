#include "coordinator/job_store.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sqlite3.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace leasehold {
namespace {

// "LHJS" in the header's application_id field: tells our store from any other
// SQLite database, so that a wrong --state-dir never reads as an empty queue.
constexpr int32_t kApplicationId = 0x4C484A53;
// user_version; raise it (and migrate in init_schema) when the tables change.
constexpr int kSchemaVersion = 1;
constexpr uint64_t kMaxColumn = std::numeric_limits<int64_t>::max();

const char* const kCreateTables = R"(
  CREATE TABLE jobs (
    id INTEGER PRIMARY KEY,
    state TEXT NOT NULL,
    finished_ms INTEGER NOT NULL,
    record BLOB NOT NULL
  );
  CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL) WITHOUT ROWID;
  INSERT INTO meta (key, value) VALUES ('next_id', 1);
)";

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw JobStoreError("job store " + path + ": " + what);
}

// SQLite's message, with the OS's reason when a system call failed (SQLite
// says only "unable to open database file" for a missing directory).
std::string describe(sqlite3* db) {
  std::string msg = sqlite3_errmsg(db);
  int code = sqlite3_errcode(db) & 0xff;
  // The OS error is only meaningful for these; otherwise it may be stale.
  int err = sqlite3_system_errno(db);
  if ((code == SQLITE_CANTOPEN || code == SQLITE_IOERR) && err != 0)
    msg += std::string(" (") + std::strerror(err) + ")";
  return msg;
}

// Resets a statement when leaving a scope, so that a SELECT left half-read
// does not keep a read transaction open and bindings do not leak into the
// next use.
class ResetOnExit {
 public:
  explicit ResetOnExit(sqlite3_stmt* s) : s_(s) {}
  ~ResetOnExit() {
    sqlite3_reset(s_);
    sqlite3_clear_bindings(s_);
  }
  ResetOnExit(const ResetOnExit&) = delete;
  ResetOnExit& operator=(const ResetOnExit&) = delete;

 private:
  sqlite3_stmt* s_;
};

// Runs a one-off statement returning a single value (set-up pragmas); on
// failure throws "<what>: <SQLite's reason>".
std::string query_text(sqlite3* db, const std::string& path, const char* sql,
                       const std::string& what) {
  sqlite3_stmt* s = nullptr;
  if (sqlite3_prepare_v2(db, sql, -1, &s, nullptr) != SQLITE_OK)
    fail(path, what + ": " + describe(db));
  std::string value;
  int rc = sqlite3_step(s);
  if (rc == SQLITE_ROW) {
    const unsigned char* text = sqlite3_column_text(s, 0);
    if (text) value = reinterpret_cast<const char*>(text);
  } else if (rc != SQLITE_DONE) {
    std::string msg = describe(db);
    sqlite3_finalize(s);
    fail(path, what + ": " + msg);
  }
  sqlite3_finalize(s);
  return value;
}

int64_t query_int(sqlite3* db, const std::string& path, const char* sql, const std::string& what) {
  return std::strtoll(query_text(db, path, sql, what).c_str(), nullptr, 10);
}

}  // namespace

// The statements used after open, prepared once.
struct JobStore::Statements {
  struct Stmt {
    sqlite3_stmt* s = nullptr;
    ~Stmt() { sqlite3_finalize(s); }
  };
  Stmt begin_read, begin_write, commit, rollback, upsert, erase, raise_next_id, select_jobs,
      select_next_id;
};

JobStore::JobStore(std::string path, sqlite3* db)
    : path_(std::move(path)), db_(db), stmts_(std::make_unique<Statements>()) {}

JobStore::~JobStore() {
  stmts_.reset();  // finalize first: sqlite3_close refuses while statements exist
  if (int rc = sqlite3_close(db_); rc != SQLITE_OK)
    spdlog::error("job store {}: close failed: {}", path_, sqlite3_errstr(rc));
}

std::unique_ptr<JobStore> JobStore::open(const std::string& path) {
  // SQLite says only "unable to open database file" for a directory; say
  // what is wrong.
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    fail(path, "is a directory, not a job store file");

  // Readable by this user alone, whatever the umask (SQLite gives its
  // journal and WAL files the database file's mode).
  if (int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600); fd >= 0) {
    if (::fchmod(fd, 0600) != 0) {
      const int err = errno;
      ::close(fd);
      fail(path, std::string("cannot make it readable by its owner only: ") + std::strerror(err));
    }
    ::close(fd);
  }
  sqlite3* db = nullptr;
  int rc = sqlite3_open_v2(
      path.c_str(), &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX, nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? describe(db) : sqlite3_errstr(rc);
    sqlite3_close(db);
    fail(path, "cannot open or create: " + msg);
  }
  std::unique_ptr<JobStore> store(new JobStore(path, db));  // closes db if what follows throws
  if (sqlite3_db_readonly(db, "main") == 1) fail(path, "cannot open for writing (read-only file?)");
  sqlite3_extended_result_codes(db, 1);
  sqlite3_busy_timeout(db, kBusyTimeoutMs);
  store->init_schema();
  store->prepare();
  return store;
}

void JobStore::init_schema() {
  // Reading the header first makes garbage fail with "file is not a database"
  // before anything is written to it.
  const std::string unreadable = "unreadable";
  int64_t app_id = query_int(db_, path_, "PRAGMA application_id", unreadable);
  int64_t version = query_int(db_, path_, "PRAGMA user_version", unreadable);
  bool fresh = false;
  if (app_id != kApplicationId) {
    if (app_id != 0) {
      char hex[16];
      std::snprintf(hex, sizeof hex, "0x%08x",
                    static_cast<unsigned>(static_cast<uint32_t>(app_id)));
      fail(path_, std::string("not a Leasehold job store (SQLite application_id ") + hex + ")");
    }
    // A missing or empty file reads as an empty database: that is a new store.
    // Anything with tables in it belongs to someone else.
    if (version != 0 ||
        query_int(db_, path_, "SELECT count(*) FROM sqlite_master", unreadable) != 0)
      fail(path_, "not a Leasehold job store (an SQLite database of another application)");
    fresh = true;
  } else if (version > kSchemaVersion) {
    fail(path_, "schema version " + std::to_string(version) + " is newer than this build's (" +
                    std::to_string(kSchemaVersion) + "); use a newer leasehold-coordinator");
  } else if (version < 1) {
    fail(path_, "unknown schema version " + std::to_string(version));
  }

  // WAL: readers (the CLI, backups) never block the writer. synchronous=FULL
  // syncs the WAL at every commit; NORMAL could lose acknowledged jobs on a
  // power cut.
  std::string mode =
      query_text(db_, path_, "PRAGMA journal_mode = WAL", "cannot set the journal mode");
  if (mode != "wal") fail(path_, "cannot switch to WAL journal mode (got '" + mode + "')");
  query_text(db_, path_, "PRAGMA synchronous = FULL", "cannot set synchronous mode");

  if (fresh) {
    // One transaction, so that a crash leaves either no schema (and the next
    // start creates it) or all of it.
    char* err = nullptr;
    std::string sql = std::string("BEGIN IMMEDIATE;") + kCreateTables +
                      "PRAGMA application_id = " + std::to_string(kApplicationId) +
                      "; PRAGMA user_version = " + std::to_string(kSchemaVersion) + "; COMMIT;";
    if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
      std::string msg = err ? err : describe(db_);
      sqlite3_free(err);
      if (!sqlite3_get_autocommit(db_)) sqlite3_exec(db_, "ROLLBACK", nullptr, nullptr, nullptr);
      fail(path_, "cannot create the schema: " + msg);
    }
    return;
  }

  // Catches truncation and torn pages at start rather than at the first read
  // of the damaged page. quick_check skips index cross-checks, so it stays
  // linear in the file size.
  sqlite3_stmt* s = nullptr;
  if (sqlite3_prepare_v2(db_, "PRAGMA quick_check", -1, &s, nullptr) != SQLITE_OK)
    fail(path_, "integrity check failed: " + describe(db_));
  std::string problems;
  int rc;
  while ((rc = sqlite3_step(s)) == SQLITE_ROW) {
    const char* row = reinterpret_cast<const char*>(sqlite3_column_text(s, 0));
    std::string line = row ? row : "";
    if (line != "ok") problems += (problems.empty() ? "" : "; ") + line;
  }
  std::string msg = rc == SQLITE_DONE ? problems : describe(db_);
  sqlite3_finalize(s);
  if (!msg.empty()) fail(path_, "integrity check failed: " + msg);
}

void JobStore::prepare() {
  auto prep = [&](Statements::Stmt& stmt, const char* sql) {
    if (sqlite3_prepare_v3(db_, sql, -1, SQLITE_PREPARE_PERSISTENT, &stmt.s, nullptr) != SQLITE_OK)
      fail(path_, std::string("cannot prepare '") + sql + "': " + describe(db_));
  };
  Statements& st = *stmts_;
  prep(st.begin_read, "BEGIN");
  prep(st.begin_write, "BEGIN IMMEDIATE");
  prep(st.commit, "COMMIT");
  prep(st.rollback, "ROLLBACK");
  prep(st.upsert,
       "INSERT INTO jobs (id, state, finished_ms, record) VALUES (?1, ?2, ?3, ?4) "
       "ON CONFLICT (id) DO UPDATE SET state = excluded.state, "
       "finished_ms = excluded.finished_ms, record = excluded.record");
  prep(st.erase, "DELETE FROM jobs WHERE id = ?1");
  prep(st.raise_next_id, "UPDATE meta SET value = max(value, ?1) WHERE key = 'next_id'");
  prep(st.select_jobs, "SELECT id, state, finished_ms, record FROM jobs ORDER BY id");
  prep(st.select_next_id, "SELECT value FROM meta WHERE key = 'next_id'");
}

JobStore::Contents JobStore::load() {
  Statements& st = *stmts_;
  auto step = [&](sqlite3_stmt* s) {
    int rc = sqlite3_step(s);
    if (rc != SQLITE_ROW && rc != SQLITE_DONE) fail(path_, "read failed: " + describe(db_));
    return rc;
  };
  // One read transaction, so that the jobs and the next id agree.
  {
    ResetOnExit r(st.begin_read.s);
    step(st.begin_read.s);
  }
  Contents out;
  try {
    ResetOnExit r1(st.select_jobs.s);
    sqlite3_stmt* s = st.select_jobs.s;
    while (step(s) == SQLITE_ROW) {
      StoredJob job;
      job.id = static_cast<uint64_t>(sqlite3_column_int64(s, 0));
      if (sqlite3_column_type(s, 3) != SQLITE_BLOB)
        fail(path_, "job " + std::to_string(job.id) + " has no record");
      const unsigned char* state = sqlite3_column_text(s, 1);
      job.state = state ? reinterpret_cast<const char*>(state) : "";
      job.finished_ms = static_cast<uint64_t>(sqlite3_column_int64(s, 2));
      // Blob before bytes: the documented order that avoids a conversion.
      auto* bytes = static_cast<const uint8_t*>(sqlite3_column_blob(s, 3));
      job.record.assign(bytes, bytes + sqlite3_column_bytes(s, 3));
      out.jobs.push_back(std::move(job));
    }
    ResetOnExit r2(st.select_next_id.s);
    if (step(st.select_next_id.s) != SQLITE_ROW) fail(path_, "the next_id row is missing");
    out.next_id = static_cast<uint64_t>(sqlite3_column_int64(st.select_next_id.s, 0));
    ResetOnExit r3(st.commit.s);
    step(st.commit.s);
  } catch (...) {
    if (!sqlite3_get_autocommit(db_)) {
      ResetOnExit r(st.rollback.s);
      sqlite3_step(st.rollback.s);
    }
    throw;
  }
  if (!out.jobs.empty()) out.next_id = std::max(out.next_id, out.jobs.back().id + 1);
  out.next_id = std::max<uint64_t>(out.next_id, 1);
  return out;
}

CommitResult JobStore::commit(const std::vector<StoredJob>& puts,
                              const std::vector<uint64_t>& deletes, uint64_t next_id) {
  // SQLite integers are signed 64-bit; refuse what would wrap instead of
  // storing a negative id.
  // Blobs and text are bound with an int length.
  constexpr size_t kMaxBytes = std::numeric_limits<int>::max();
  for (const StoredJob& job : puts)
    if (job.id > kMaxColumn || job.finished_ms > kMaxColumn || job.record.size() > kMaxBytes ||
        job.state.size() > kMaxBytes)
      return {false, "job store " + path_ + ": job " + std::to_string(job.id) + " out of range"};
  for (const StoredJob& job : puts) next_id = std::max(next_id, job.id + 1);
  next_id = std::min<uint64_t>(next_id, kMaxColumn);

  Statements& st = *stmts_;
  auto run = [&](sqlite3_stmt* s) {
    ResetOnExit r(s);
    return sqlite3_step(s) == SQLITE_DONE;
  };
  auto failed = [&] {
    std::string msg = describe(db_);  // before ROLLBACK replaces it
    // Some errors (disk full, I/O) already rolled the transaction back.
    if (!sqlite3_get_autocommit(db_)) run(st.rollback.s);
    return CommitResult{false, "job store " + path_ + ": commit failed: " + msg};
  };

  if (!run(st.begin_write.s)) return failed();
  static const uint8_t kEmpty = 0;  // a null pointer would bind NULL, not an empty blob
  for (const StoredJob& job : puts) {
    sqlite3_stmt* s = st.upsert.s;
    if (sqlite3_bind_int64(s, 1, static_cast<int64_t>(job.id)) != SQLITE_OK ||
        sqlite3_bind_text(s, 2, job.state.data(), static_cast<int>(job.state.size()),
                          SQLITE_STATIC) != SQLITE_OK ||
        sqlite3_bind_int64(s, 3, static_cast<int64_t>(job.finished_ms)) != SQLITE_OK ||
        sqlite3_bind_blob(s, 4, job.record.empty() ? &kEmpty : job.record.data(),
                          static_cast<int>(job.record.size()), SQLITE_STATIC) != SQLITE_OK) {
      sqlite3_clear_bindings(s);
      return failed();
    }
    if (!run(s)) return failed();
  }
  for (uint64_t id : deletes) {
    if (id > kMaxColumn) continue;  // cannot be stored, so nothing to delete
    if (sqlite3_bind_int64(st.erase.s, 1, static_cast<int64_t>(id)) != SQLITE_OK) return failed();
    if (!run(st.erase.s)) return failed();
  }
  if (sqlite3_bind_int64(st.raise_next_id.s, 1, static_cast<int64_t>(next_id)) != SQLITE_OK)
    return failed();
  if (!run(st.raise_next_id.s)) return failed();
  if (sqlite3_changes(db_) != 1) {
    run(st.rollback.s);
    return {false, "job store " + path_ + ": commit failed: the next_id row is missing"};
  }
  if (!run(st.commit.s)) return failed();
  return {};
}

}  // namespace leasehold
