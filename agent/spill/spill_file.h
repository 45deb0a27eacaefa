// One job's spill file: DIRECTORY/spill-PID-TAG.bin, opened with O_DIRECT
// (plain buffered I/O, with a warning, where the file system refuses it),
// grown with fallocate ahead of use, and placed in 4 KiB-aligned extents
// that are reused after free. Closed and removed when destroyed. The tiered
// store (tiered_store.h) keeps tensors in it.
//
// Thread safety: allocate/free/used_bytes need external locking;
// write/read may run on several threads at once (pwrite/pread).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "shared/pool_allocator.h"
#include "shared/status.h"

namespace leasehold::spill {

class SpillFile {
 public:
  static constexpr uint64_t kPage = 4096;  // O_DIRECT alignment of offsets, sizes, buffers

  // Creates the file; `limit` caps its size (0: until the disk is full).
  // Errors name the path and the errno.
  static Status create(const std::string& directory, const std::string& tag, bool direct_io,
                       uint64_t limit, std::unique_ptr<SpillFile>* out);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  const std::string& path() const { return path_; }

  // A free extent of `bytes` (rounded up to pages); nullopt when none is
  // left (fullness() says why).
  std::optional<uint64_t> place(uint64_t bytes);
  // Preallocates the file up to `end` at least. Errors: the failing
  // fallocate's errno (ENOSPC: the disk is full), naming the file.
  Status grow_to(uint64_t end);
  // "spill file PATH has N in use of its limit of M", for messages.
  std::string fullness() const;
  void free(uint64_t offset) { extents_.free(offset); }
  uint64_t used_bytes() const { return extents_.used_bytes(); }

  // pwrite/pread of exactly `n` bytes at `offset`, resuming after short
  // transfers and signals. Returns 0 or the errno; -1 from read means the
  // file ended first.
  int write(const char* p, size_t n, uint64_t offset) const;
  int read(char* p, size_t n, uint64_t offset) const;

 private:
  SpillFile(int fd, std::string path, std::string directory, uint64_t limit);

  int fd_;
  std::string path_, directory_;
  uint64_t limit_;
  PoolAllocator extents_;
  uint64_t size_ = 0;
};

// Removes the spill files in `directory` left by processes that no longer
// run (spill-PID-*.bin whose PID is gone). Returns how many were removed;
// a missing directory is not an error.
int remove_stale_spill_files(const std::string& directory);

}  // namespace leasehold::spill
