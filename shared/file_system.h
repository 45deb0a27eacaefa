// The file operations that durable writes need, behind an interface (as
// LevelDB's Env) so that tests can substitute a file system that fails or
// loses power at any step. Every operation returns a Status and never throws;
// every error message names the path and the system's reason, e.g.
// "cannot write /x/y.ckpt.tmp: No space left on device".
//
// Durability, as POSIX gives it: bytes appended to a file survive a crash
// only after WritableFile::sync(); a created, renamed or removed directory
// entry survives only after sync_dir() of its directory.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <sys/types.h>

#include "shared/status.h"

namespace leasehold {

// One open file being written. Not thread-safe: one owner at a time. Must not
// outlive the FileSystem that opened it.
class WritableFile {
 public:
  // Closes the file if still open, ignoring errors: call close() to see them.
  virtual ~WritableFile() = default;
  // Appends all of `data`, or fails (possibly having written a prefix).
  virtual Status append(std::string_view data) = 0;
  // Makes the bytes appended so far durable (fsync).
  virtual Status sync() = 0;
  // Closes the file; later calls of any method fail. An error here can mean
  // that appended data was lost, so callers that care must check it.
  virtual Status close() = 0;
};

// Thread-safe: any number of threads may call any method at once.
class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // Creates `path`, or truncates it if it exists, for writing. On success
  // `*out` owns the open file; on failure `*out` is left unchanged.
  virtual Status new_writable_file(const std::string& path, std::unique_ptr<WritableFile>* out) = 0;
  // Replaces `*contents` with the whole file. not_found when it is missing;
  // a file of more than `max_bytes` is an error (EFBIG) read no further
  // than that; `*contents` is unspecified after any failure.
  virtual Status read_file(const std::string& path, std::string* contents,
                           size_t max_bytes = SIZE_MAX) = 0;
  // Atomically replaces `to` (if it exists) by `from`: a reader sees one or
  // the other, never neither. Durable only after sync_dir of both parents.
  virtual Status rename(const std::string& from, const std::string& to) = 0;
  // Removes a file; not_found when it is missing.
  virtual Status remove(const std::string& path) = 0;
  // Makes the creations, renames and removals of entries in `dir` durable.
  virtual Status sync_dir(const std::string& dir) = 0;
  // Creates `dir` and any missing parents; succeeds if it already exists.
  virtual Status create_dirs(const std::string& dir) = 0;
  // Whether a file or directory exists at `path`; false on any error.
  virtual bool exists(const std::string& path) = 0;
};

// The operating system's file system (open/write/fsync/rename, retrying on
// EINTR, descriptors opened O_CLOEXEC). Lives for the whole program.
FileSystem& default_file_system();

// The same, with every relative path resolved from the open directory
// `dir_fd` (not owned; it must outlive the result) and no link followed to
// read, write or test a file. New files get `file_mode` (before the umask).
// Messages name a relative path inside `shown_as` (the folder's path).
std::unique_ptr<FileSystem> file_system_at(int dir_fd, mode_t file_mode,
                                           const std::string& shown_as);

}  // namespace leasehold
