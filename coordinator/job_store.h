// The coordinator's durable job store: one SQLite file (WAL journal,
// synchronous=FULL) holding every job as an opaque record plus the columns
// needed to query and prune it, and the next job id to hand out. A job the
// coordinator has acknowledged must survive a crash, and an id must never be
// handed out twice, even after the jobs that used it were pruned.
//
// Thread safety: one SQLite connection without locking of its own; a
// JobStore may be used from any thread, but by one thread at a time
// (StoreWriter owns it on its writer thread). Other processes may read the
// file while it is open (WAL lets them), but only this object should write it.
#pragma once

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

struct sqlite3;

namespace leasehold {

struct StoredJob {
  uint64_t id = 0;
  std::string state;            // "queued", "running", "succeeded", ... (for queries and pruning)
  uint64_t finished_ms = 0;     // Unix ms when it reached a final state; 0 while not finished
  std::vector<uint8_t> record;  // the coordinator's serialized job (opaque here)
};

// Thrown by open() and load(); the message names the file and what is wrong.
class JobStoreError : public std::runtime_error {
 public:
  using runtime_error::runtime_error;
};

// The outcome of a commit: ok, or an error naming the file and SQLite's
// reason ("database is locked", "database or disk is full", ...).
struct CommitResult {
  bool ok = true;
  std::string error;
};

class JobStore {
 public:
  // Opens the store at `path`, creating and initialising it when the file is
  // missing or empty (its directory must exist). Throws JobStoreError naming
  // `path` when it cannot be opened or created (permissions, a directory, a
  // missing parent), is not a Leasehold job store (another application's
  // SQLite database, or not SQLite at all), fails PRAGMA quick_check (e.g.
  // truncated), or was written by a newer schema version than this build.
  static std::unique_ptr<JobStore> open(const std::string& path);
  // Closes the connection; never throws (a close failure is logged).
  ~JobStore();
  JobStore(const JobStore&) = delete;
  JobStore& operator=(const JobStore&) = delete;

  struct Contents {
    std::vector<StoredJob> jobs;  // in id order
    uint64_t next_id = 1;         // never below 1 + the largest id ever committed
  };
  // Reads everything in one read transaction. Throws JobStoreError naming the
  // file on a read error (including corruption found while reading).
  Contents load();

  // One transaction: upserts `puts` by id, then deletes `deletes` (so an id in
  // both ends up deleted), and raises the stored next id to at least
  // max(`next_id`, 1 + the largest id put); it is never lowered, so pruning
  // cannot bring an id back. Returns ok once the transaction is durable. On
  // failure rolls back (nothing is half-applied) and returns the error, naming
  // the file; the store stays usable and the same commit may be retried.
  // Busy waits for another writer are bounded by kBusyTimeoutMs.
  CommitResult commit(const std::vector<StoredJob>& puts, const std::vector<uint64_t>& deletes,
                      uint64_t next_id);

  const std::string& path() const { return path_; }

  // How long a statement waits for a lock held by another connection before
  // failing with "database is locked". Short, because callers retry.
  static constexpr int kBusyTimeoutMs = 1000;

 private:
  struct Statements;
  JobStore(std::string path, sqlite3* db);
  void init_schema();
  void prepare();

  std::string path_;
  sqlite3* db_;
  std::unique_ptr<Statements> stmts_;
};

}  // namespace leasehold
