// The real spill store: a tensor goes to the host tier (a region of pinned
// host memory allocated once at agent start, which the job's page-locked
// tensors share: host_tier.h) when it fits there, else to the spill file.
// See spill_store.h for the contract.
//
// The spill file (one per job, created at the first put that needs it):
// DIRECTORY/spill-PID-TAG.bin, opened with O_DIRECT (plain buffered I/O,
// with a warning, where the file system refuses O_DIRECT, e.g. tmpfs),
// grown with fallocate ahead of use, placed in 4 KiB-aligned extents that
// are reused after erase. Bytes reach it in chunks of `chunk_bytes`: each
// chunk is copied off the device into a pinned staging buffer (a ring of
// `staging` memory) and written by a small thread pool with pwrite; reads
// come back the same way. Every chunk carries an XXH3 checksum checked on
// read. A get() for a chunk whose write is still in flight is served from
// its staging buffer. The file is removed when the store is destroyed.
#pragma once

#include <memory>
#include <string>

#include "agent/spill/spill_file.h"  // remove_stale_spill_files
#include "agent/spill/spill_store.h"
#include "agent/spill/transfer.h"

namespace leasehold::spill {

struct TieredStoreOptions {
  // Host tier: memory owned by the agent (null or 0 bytes: no host tier),
  // and the most of it this store may hold (0: all of it).
  PinnedBuffer* host_tier = nullptr;
  uint64_t host_limit = 0;
  // Staging ring for the file tier (null: no file tier): split into chunks
  // of chunk_bytes; at least 2 chunks.
  PinnedBuffer* staging = nullptr;
  size_t chunk_bytes = 1 << 20;  // a multiple of 4 KiB
  // Spill file: directory (empty: no file tier), the TAG of its name, and the
  // most bytes it may grow to (0: until the disk is full).
  std::string directory;
  std::string tag;
  uint64_t file_limit = 0;
  int io_threads = 4;
  bool direct_io = true;
};

class TieredSpillStore final : public SpillStore {
 public:
  // `transfer` must outlive the store. Never fails: the file is created
  // lazily and its errors are reported by put().
  TieredSpillStore(Transfer& transfer, TieredStoreOptions options);
  // Waits for I/O in flight, then closes and removes the spill file.
  ~TieredSpillStore() override;

  Status put(SpillId id, const void* src, size_t bytes, const std::string& name) override;
  bool copied(SpillId id) override;
  Status wait_copied(SpillId id) override;
  void prefetch(SpillId id) override;
  Status get(SpillId id, void* dst) override;
  Status get_async(SpillId id, void* dst, std::shared_ptr<Fence>* done) override;
  void erase(SpillId id) override;
  SpillStats stats() const override;
  std::shared_ptr<engine::Allocator> host_allocator() override;

  // Waits until every write (and read) in flight has finished; returns the
  // first write error, if any (the one later puts fail with). For tests and
  // for callers that want the file complete before going on.
  Status flush();

  // The spill file's path (empty before the first file-tier put).
  std::string file_path() const;

 private:
  class Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace leasehold::spill
