// An in-memory FileSystem for tests that models what survives a power loss,
// and injects errors and crashes at chosen operations.
//
// Model: every file (inode) has its current bytes and its last-synced bytes;
// every directory has its current entries and its durable entries, which
// become the current ones on sync_dir(). crash() throws away everything not
// durable. Truncating an existing file (new_writable_file on it) is durable
// at once: the pessimistic outcome where the metadata reached the disk and
// the new data did not. Directories themselves, once created, are durable.
// Paths are absolute, with no "." or ".." components.
#pragma once

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "shared/file_system.h"

namespace leasehold::testing {

class MemoryFileSystem final : public FileSystem {
 public:
  // The operation kinds that faults can target. All but Read are mutating.
  enum class Op { Create, Append, Sync, Close, Rename, Remove, SyncDir, CreateDirs, Read };

  // An empty file system holding only the root directory "/".
  MemoryFileSystem();
  ~MemoryFileSystem() override;

  Status new_writable_file(const std::string& path, std::unique_ptr<WritableFile>* out) override;
  Status read_file(const std::string& path, std::string* contents,
                   size_t max_bytes = SIZE_MAX) override;
  Status rename(const std::string& from, const std::string& to) override;
  Status remove(const std::string& path) override;
  Status sync_dir(const std::string& dir) override;
  Status create_dirs(const std::string& dir) override;
  bool exists(const std::string& path) override;

  // The (skip+1)-th call of `op` from now fails with `err` and has no
  // effect (a failed close still closes the file). Faults are independent:
  // each counts calls from its own registration.
  void fail_next(Op op, int err, int skip = 0);
  // `n` more mutating operations succeed; then the machine is dead: every
  // operation fails with EIO (exists() returns false) until crash().
  void crash_after(int n);
  // Power loss and reboot: every directory's entries become its durable ones,
  // every file's bytes its synced ones; pending faults and crash_after are
  // cleared. Files still open stay usable but write to orphaned inodes.
  void crash();

  // Mutating operations attempted so far, failed ones included; a file
  // destroyed without close() is closed silently and not counted.
  int mutating_ops() const;
  // Calls of `op` attempted so far.
  int calls(Op op) const;
  // Names of the files now in `dir` (not subdirectories), sorted; empty if
  // `dir` is missing.
  std::vector<std::string> list(const std::string& dir) const;
  // The current bytes of a file. Throws std::out_of_range when it is missing.
  std::string contents(const std::string& path) const;

 private:
  struct Inode {
    std::string data, synced;
  };
  using Entries = std::map<std::string, std::shared_ptr<Inode>>;
  struct Dir {
    Entries entries, durable;
  };
  struct Fault {
    Op op;
    int err;
    int skip;
  };
  class File;

  // Counts the call and decides whether it fails: returns the errno of a
  // dead machine or an injected fault, else 0. Requires mu_ held.
  int begin(Op op);
  Dir* find_dir(const std::string& dir);
  const Dir* find_dir(const std::string& dir) const;

  mutable std::mutex mu_;
  std::map<std::string, Dir> dirs_;
  std::vector<std::weak_ptr<Inode>> inodes_;  // every inode made, for crash()
  std::vector<Fault> faults_;
  std::map<Op, int> calls_;
  int mutating_ops_ = 0;
  int crash_budget_ = -1;  // mutating operations left before dying; -1: no crash planned
  bool dead_ = false;
};

}  // namespace leasehold::testing
