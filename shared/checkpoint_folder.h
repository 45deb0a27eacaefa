// Where a job's checkpoints may be written and read, and how. A checkpoint
// folder is either the job's private folder under the coordinator's state
// folder (STATE_DIR/checkpoints/ID, created by the agent with mode 0700), or
// a folder the job file names, which must already exist and belong to the
// job's submitter: the agent writes a user's checkpoint only where that user
// could write it themselves. System folders are refused to everyone.
//
// The rules hold at every write and every resume, not only at submit: the
// folder is opened afresh each time by walking its path one component at a
// time with O_NOFOLLOW (a link anywhere in it is refused, so a folder
// swapped for a link after submission is caught), its owner and mode are
// checked on the open descriptor, and every file in it is opened relative to
// that descriptor, again without following links. A path with "." or ".."
// components is refused; the coordinator stores the folder's canonical path
// at submit.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "shared/file_system.h"

namespace leasehold {

// Whose checkpoints a folder holds.
struct CheckpointOwner {
  // The job's private folder under the state folder: owned by the agent's
  // own user, mode 0700, created when missing.
  bool private_folder = false;
  // Otherwise the uid of the job's submitter, who must own the folder; -1
  // when not known (a submitter over CURVE): then only the private folder.
  int64_t uid = -1;

  // Folders of this process's own user (a job run outside an agent).
  static CheckpointOwner this_user();
};

// Why `dir` may not be named as the checkpoint folder of a job submitted by
// `uid` (-1: not known); nullopt when it may. Refuses relative paths, "."
// and ".." components, system folders, a folder that does not exist or is
// reached through a link, and one another user owns.
std::optional<std::string> checkpoint_folder_refusal(const std::string& dir, int64_t uid);

// One open checkpoint folder: a FileSystem that takes only paths of files
// directly inside it (DIR/NAME) and the folder itself (create_dirs and
// sync_dir), and opens every file relative to the folder's descriptor
// without following links. Files are created with mode 0600.
class CheckpointFolder final : public FileSystem {
 public:
  // Opens `dir` and checks it against `owner` (creating the private folder
  // when `create`). Throws std::runtime_error naming the folder and the
  // rule it breaks; std::system_error (ENOENT) when it does not exist and
  // is not to be created.
  CheckpointFolder(const std::string& dir, const CheckpointOwner& owner, bool create);
  ~CheckpointFolder() override;
  CheckpointFolder(const CheckpointFolder&) = delete;
  CheckpointFolder& operator=(const CheckpointFolder&) = delete;

  const std::string& path() const { return dir_; }

  Status new_writable_file(const std::string& path, std::unique_ptr<WritableFile>* out) override;
  Status read_file(const std::string& path, std::string* contents,
                   size_t max_bytes = SIZE_MAX) override;
  Status rename(const std::string& from, const std::string& to) override;
  Status remove(const std::string& path) override;
  Status sync_dir(const std::string& dir) override;
  Status create_dirs(const std::string& dir) override;
  bool exists(const std::string& path) override;

  // Up to `max_bytes` of the regular file `name` in this folder from
  // `offset` into `out`, its size in `total` and in `version` what tells
  // one file from the next written under that name (inode and change
  // time): a checkpoint fetched in pieces by its owner, restarted when it
  // was replaced meanwhile. Never follows a link, and refuses a file with
  // more than one link (a hard link could name a file elsewhere).
  Status read_range(const std::string& name, uint64_t offset, size_t max_bytes, std::string* out,
                    uint64_t* total, uint64_t* version);

 private:
  // The name in this folder of `path` (DIR/NAME); nullopt for any other.
  std::optional<std::string> name_of(const std::string& path) const;
  Status outside(const std::string& path) const;

  std::string dir_;
  int fd_ = -1;
  std::unique_ptr<FileSystem> files_;  // relative to fd_
};

}  // namespace leasehold
