// Off-loop file work for the coordinator: checking the dataset files of a
// submitted job (which opens and reads them), and removing the checkpoint
// folders of pruned jobs. A file on a slow or hung file system holds up a
// worker thread here, never the poll loop; the core answers the client when
// a check takes too long.
//
// Thread safety: all methods are thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "coordinator/effects.h"

namespace leasehold {

class FileWorkers {
 public:
  struct CheckResult {
    uint64_t token = 0;
    std::vector<std::string> problems;  // empty: the job is valid
  };

  // Starts `threads` workers. `notify` runs on a worker after each finished
  // check (to wake the poll loop).
  FileWorkers(size_t threads, std::function<void()> notify);
  // Stops the workers; waits a little for running work, then leaves threads
  // stuck in I/O behind (they end with the process). Never throws.
  ~FileWorkers();
  FileWorkers(const FileWorkers&) = delete;
  FileWorkers& operator=(const FileWorkers&) = delete;

  // What a CheckpointRead found: `data` from its offset, the file's size
  // and version, or why it could not be read.
  struct ReadResult {
    uint64_t token = 0;
    bool ok = false;
    bool missing = false;  // no file (or folder) of that name yet
    bool refused = false;  // the folder breaks the rules (a link, another owner)
    std::string error;
    std::string data;
    uint64_t total = 0, version = 0;
  };

  void check(FileCheck check);
  void read(CheckpointRead read);
  void remove_dir(std::string dir);
  // Results finished since the last call.
  std::vector<CheckResult> take_results();
  std::vector<ReadResult> take_reads();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace leasehold
