// A job's checkpoints (job_runner.h): the resume from its last one and the
// write after an epoch. The checkpoint folder is opened and checked afresh
// for the resume and for every write (shared/checkpoint_folder.h), so that
// one swapped for a link, or handed to another user, after submission is
// refused then.
//
// A checkpoint holds the parameters, the optimizer's state ("sgd." and
// "adam." names), the epoch it ends ("job.epoch") and that epoch's report
// ("job.last_epoch"), replayed on resume: the run that wrote it may have
// died before the report was delivered.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "agent/engine/nn.h"
#include "agent/engine/optim.h"
#include "agent/job_runner.h"
#include "schemas/job_generated.h"
#include "shared/checkpoint_folder.h"
#include "shared/file_system.h"

namespace leasehold {

class JobCheckpoints {
 public:
  // `file_system` (may be null): used instead of the job's folder (tests).
  // `job` must outlive the object.
  JobCheckpoints(const proto::JobSpec& job, FileSystem* file_system, CheckpointOwner owner);

  // Whether the job checkpoints at all, and to which file.
  bool enabled() const { return !file_.empty(); }
  const std::string& file() const { return file_; }
  // Whether `epoch` (1-based) of `epochs` ends with a checkpoint.
  bool due(int64_t epoch, int64_t epochs) const;

  struct Resumed {
    int64_t epoch = 0;                // the epochs the checkpoint covers (its last, 1-based)
    std::optional<EpochReport> last;  // that epoch's report, to replay
  };
  // The last checkpoint into `model`'s parameters and `optimizer`'s state
  // (moved to `device`), when there is one; nullopt otherwise (the job
  // does not checkpoint, no folder yet, or no file in it). Reads never
  // more than the job's resident bytes and some headers. Throws
  // std::runtime_error naming the file for a folder that cannot be used, a
  // file that cannot be read or is not a job checkpoint; a checkpoint that
  // lacks a parameter or state the job has throws what
  // engine::checkpoint::restore and Optimizer::load_state throw.
  std::optional<Resumed> resume(engine::nn::Module& model, engine::optim::Optimizer& optimizer,
                                engine::Device device);
  // Writes epoch `report.epoch`'s checkpoint of `model` and `optimizer`
  // (engine/checkpoint.h: a new file renamed over the old). Throws
  // std::runtime_error naming the file. REQUIRES: enabled().
  void write(const EpochReport& report, const engine::nn::Module& model,
             const engine::optim::Optimizer& optimizer);

 private:
  // The folder's file system, opened and checked now; null when it does
  // not exist yet and `write` is false.
  FileSystem* open(bool write);

  const proto::JobSpec& job_;
  FileSystem* file_system_;
  CheckpointOwner owner_;
  std::string file_;
  std::unique_ptr<CheckpointFolder> folder_;
};

}  // namespace leasehold
