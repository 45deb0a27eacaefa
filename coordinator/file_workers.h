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

  void check(FileCheck check);
  void remove_dir(std::string dir);
  // Results finished since the last call.
  std::vector<CheckResult> take_results();

 private:
  struct State;
  std::shared_ptr<State> state_;
};

}  // namespace leasehold
