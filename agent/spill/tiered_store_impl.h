// The inside of TieredSpillStore (tiered_store.h), shared by the three
// files that implement it: tiered_store.cpp (the store's life, puts into
// either tier, erase and stats), tiered_store_reads.cpp (the staging
// slots, waiting for copies, prefetches and gets) and tiered_store_io.cpp
// (the I/O threads: chunk writes with their checksums, and reads). Not an
// interface: nothing outside those files includes it.
#pragma once

#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "agent/spill/host_tier.h"
#include "agent/spill/spill_file.h"
#include "agent/spill/tiered_store.h"

namespace leasehold::spill::tiered_store_detail {

inline constexpr uint64_t kPage = SpillFile::kPage;

using Clock = std::chrono::steady_clock;

inline std::string bytes_text(uint64_t n) { return std::to_string(n) + " bytes"; }

inline Status from_exception(const std::string& context, const std::exception& e) {
  // A device fault (CudaError) or an allocation failure: no errno of its own.
  return Status::io_error(context + ": " + e.what(), EIO);
}

}  // namespace leasehold::spill::tiered_store_detail

namespace leasehold::spill {

class TieredSpillStore::Impl {
 public:
  Impl(Transfer& transfer, TieredStoreOptions options);
  ~Impl();

  Status put(SpillId id, const void* src, size_t bytes, const std::string& name);
  bool copied(SpillId id);
  Status wait_copied(SpillId id);
  void prefetch(SpillId id);
  Status get(SpillId id, void* dst, std::shared_ptr<Fence>* done);
  void erase(SpillId id);
  SpillStats stats() const;
  std::shared_ptr<engine::Allocator> host_allocator() const { return host_allocator_; }
  Status flush();
  std::string file_path() const;

 private:
  enum class Tier : uint8_t { None, Host, File };
  // A staging slot: Free (reusable once `h2d` is done), Writing (holds a
  // chunk copied off the device until the I/O thread has written it),
  // Reading (an I/O thread is reading a chunk into it) or Loaded (holds a
  // chunk read back, or the error of that read, until a get uses it).
  enum class SlotState : uint8_t { Free, Writing, Reading, Loaded };

  struct Chunk {
    uint64_t offset = 0;  // in the file
    size_t len = 0;       // tensor bytes; the file holds it padded to a page
    uint64_t hash = 0;    // XXH3 of the padded bytes, valid when written
    bool written = false;
    int slot = -1;               // the staging slot holding its bytes, if any
    std::shared_ptr<Fence> d2h;  // the copy into its slot; null once seen done
  };

  struct Entry {
    std::string name;
    size_t bytes = 0;
    Tier tier = Tier::None;
    uint64_t offset = 0;           // host-tier region or file extent
    std::shared_ptr<Fence> fence;  // host tier: the copy into the region
    std::vector<Chunk> chunks;     // file tier
    int io_pending = 0;            // I/O tasks queued or running for it
    Status error;                  // a failed copy or write: its bytes are lost
  };

  struct Slot {
    SlotState state = SlotState::Free;
    SpillId owner = 0;
    size_t chunk = 0;
    bool prefetched = false;     // counted in prefetch_slots_
    Status read_status;          // Loaded: the outcome of the read
    std::shared_ptr<Fence> h2d;  // the last copy out of it to the device
    uint64_t last_use = 0;
  };

  struct Task {
    bool write = true;
    SpillId id = 0;
    size_t chunk = 0;
    int slot = -1;
    uint64_t offset = 0;
    size_t len = 0;
    uint64_t hash = 0;             // read: the expected checksum
    std::shared_ptr<Fence> fence;  // write: the copy into the slot
    std::string name;
  };

  // A task for chunk `k` of `e` in slot `s`; the caller adds what differs.
  static Task task_for(bool write, SpillId id, const Entry& e, size_t k, int s);
  void enqueue_locked(Entry& e, Task t);  // REQUIRES: mu_ held
  char* slot_data(int s) const { return opt_.staging->data() + static_cast<size_t>(s) * chunk_; }
  std::string chunk_where(const Task& t) const {
    return "chunk " + std::to_string(t.chunk) + " of tensor " + t.name + " (offset " +
           std::to_string(t.offset) + ")";
  }

  Status put_host(std::unique_lock<std::mutex>& lock, SpillId id, const char* src, size_t bytes,
                  const std::string& name, uint64_t offset);
  Status put_file(std::unique_lock<std::mutex>& lock, SpillId id, const char* src, size_t bytes,
                  const std::string& name);
  Status get_file(std::unique_lock<std::mutex>& lock, SpillId id, Entry& e, char* dst,
                  std::shared_ptr<Fence>* done);
  Status no_room(const std::string& name, size_t bytes, const std::string& why) const;
  Status open_file_locked();

  // A slot that is free now, or -1. REQUIRES: mu_ held.
  int take_free_slot_locked();
  // Waits until a slot is free. Loaded slots are taken back from their
  // chunks when nothing else can free one (prefetched data of other
  // entries first, then `keep`'s chunks after `keep_chunk`, farthest first).
  // Returns -1 only when no slot can ever be had. May release the lock.
  int acquire_slot(std::unique_lock<std::mutex>& lock, std::optional<SpillId> keep,
                   size_t keep_chunk);
  void release_slot_locked(int s);
  void issue_read_locked(SpillId id, Entry& e, size_t k, int s, bool prefetched);
  // Waits for the entry's I/O, then frees everything it holds and forgets it.
  void drop_locked(std::unique_lock<std::mutex>& lock, SpillId id);

  void start_threads_locked();
  void worker();
  void run_write(Task& t);
  void run_read(Task& t);
  void io_begin();
  void io_end();

  Transfer& transfer_;
  TieredStoreOptions opt_;
  size_t chunk_ = 0;
  int nslots_ = 0;
  int max_prefetch_slots_ = 0;
  Status file_tier_problem_;  // why the options allow no file tier (empty: allowed)

  mutable std::mutex mu_;
  std::condition_variable io_done_;     // an I/O task finished
  std::condition_variable work_ready_;  // a task was queued, or stop_
  std::deque<Task> tasks_;
  std::vector<std::thread> threads_;
  bool stop_ = false;

  std::unordered_map<SpillId, Entry> entries_;
  std::shared_ptr<HostTier> host_;  // null: no host tier
  std::shared_ptr<engine::Allocator> host_allocator_;  // host_'s planned tensors (null: none)
  std::vector<Slot> slots_;
  int prefetch_slots_ = 0;
  uint64_t use_clock_ = 0;
  int io_pending_ = 0;
  Status sticky_;  // the first failed write: later puts fail with it

  std::unique_ptr<SpillFile> file_;  // created at the first file-tier put
  std::string path_;                 // file_'s, for messages

  SpillStats stats_;  // all but the busy times

  // Wall time with at least one read or write in flight (own lock: taken
  // around every syscall, never while waiting for mu_).
  mutable std::mutex busy_mu_;
  int io_active_ = 0;
  tiered_store_detail::Clock::time_point io_since_;
  tiered_store_detail::Clock::duration io_busy_{};
};

}  // namespace leasehold::spill
