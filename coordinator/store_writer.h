// Writes to the job store from a background thread, so that the
// coordinator's poll loop never waits for a disk sync or a lock. Writes that
// pile up while a commit is in progress go out together in the next
// transaction (group commit); a failed commit keeps them and retries with
// backoff, so nothing queued is dropped while the process lives.
//
// Thread safety: write(), committed() and error() may be called from any
// thread at any time; the writer thread alone uses the JobStore. Destroying
// the writer while another thread still calls write() is a bug.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/job_store.h"

namespace leasehold {

class StoreWriter {
 public:
  // Takes the store and starts the writer thread. `notify` is called on the
  // writer thread after every commit attempt, successful or not, with no lock
  // held (it may call committed() and error()); it must be cheap and should
  // not throw (an exception is logged and ignored). Throws
  // std::invalid_argument when `store` is null.
  StoreWriter(std::unique_ptr<JobStore> store, std::function<void()> notify,
              std::chrono::milliseconds drain_timeout = std::chrono::seconds(5));
  // Commits what is still queued, trying for at most `drain_timeout` (no new
  // attempt starts after it; one in progress finishes, bounded by the store's
  // busy timeout), then stops the thread and closes the store. Logs how many
  // writes were not committed, if any. Never throws.
  ~StoreWriter();
  StoreWriter(const StoreWriter&) = delete;
  StoreWriter& operator=(const StoreWriter&) = delete;

  // Queues a write and returns its sequence number (1, 2, 3, ...). Within a
  // write, as in JobStore::commit, deletes apply after puts. Across writes
  // that share a transaction the later one wins for each id: the latest put
  // replaces earlier ones, a delete after a put removes the job, a put after a
  // delete re-adds it; next_id is the largest asked for. Never blocks on I/O
  // (the lock it takes is never held across a commit).
  uint64_t write(std::vector<StoredJob> puts, std::vector<uint64_t> deletes, uint64_t next_id);
  // Every write with a sequence number <= committed() is durable. Only grows.
  uint64_t committed() const;
  // Empty while healthy; the last failed commit's error (naming the file)
  // while commits fail. Cleared by the next successful commit.
  std::string error() const;

 private:
  // Merged writes: per id, the job to put, or nullopt to delete it.
  struct Batch {
    std::map<uint64_t, std::optional<StoredJob>> ops;
    uint64_t next_id = 0;
    uint64_t seq = 0;  // the last write merged in; 0 when empty
  };
  void run();
  CommitResult commit(const Batch& batch);

  std::unique_ptr<JobStore> store_;
  std::function<void()> notify_;
  const std::chrono::milliseconds drain_timeout_;

  mutable std::mutex mu_;
  std::condition_variable wake_;
  Batch pending_;                                         // guarded by mu_
  uint64_t last_seq_ = 0;                                 // guarded by mu_
  std::string error_;                                     // guarded by mu_
  bool stopping_ = false;                                 // guarded by mu_
  std::chrono::steady_clock::time_point drain_deadline_;  // guarded by mu_
  std::atomic<uint64_t> committed_{0};
  std::thread thread_;  // last, so that it starts after the members above exist
};

}  // namespace leasehold
