// Runs one training job with the engine: loads the dataset, builds the
// model, trains with the job's optimiser, evaluates test accuracy after each
// epoch, writes checkpoints and resumes from the last one. Memory for
// tensors comes from the thread's current allocator (the agent installs its
// lease allocator first), so the job runs inside its leases.
//
// A resumed run is the uninterrupted run: the checkpoint holds parameters
// and optimiser state, the data order of an epoch depends only on the seed
// and the epoch, and the random numbers (dropout) come from the seed and the
// step's number (engine::StepRandom). An epoch's checkpoint is written
// before the epoch is reported, so a reported checkpoint always exists.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/replica.h"
#include "agent/spill/spill_manager.h"
#include "lease_client/session.h"
#include "shared/checkpoint_folder.h"
#include "shared/file_system.h"
#include "schemas/job_generated.h"

namespace leasehold {

struct JobProgress {
  int64_t epoch = 0, epochs = 0;          // 1-based epoch
  int64_t step = 0, steps_in_epoch = 0;   // within the epoch
  int64_t global_step = 0, total_steps = 0;
  double loss = 0;                        // mean over the steps since the last report
  double samples_per_second = 0;
  double eta_seconds = 0;
  // Memory: the most the job's allocator held at once, what its spill store
  // holds now in each tier, and the bytes moved out and back so far.
  uint64_t peak_device_bytes = 0;
  uint64_t spill_host_bytes = 0, spill_file_bytes = 0;
  uint64_t spilled_bytes = 0, restored_bytes = 0;
};

struct EpochReport {
  int64_t epoch = 0;
  double train_loss = 0;
  double test_accuracy = 0;  // fraction in [0, 1] (text: next-token accuracy)
  double seconds = 0;
  bool checkpointed = false;  // its checkpoint was written before this report
  // Text jobs: mean next-token cross-entropy (nats) over the validation
  // part; 0 for image jobs.
  double validation_loss = 0;
};

struct JobResult {
  std::vector<EpochReport> epochs;
  double test_accuracy = 0;
  double samples_per_second = 0;  // training throughput
  int64_t steps = 0;
  double seconds = 0;
  int64_t resumed_from_epoch = 0;  // 0: started fresh
  int64_t graph_steps = 0;         // steps run as one CUDA graph launch each
  // Transformer blocks recomputing their MLP, recomputing whole but their
  // attention, recomputing whole, and recomputing their two halves apart,
  // in backward at the end, to stay within the memory budget
  // (recompute_policy.h).
  int recomputed_mlps = 0;
  int recomputed_blocks_but_attention = 0;
  int recomputed_blocks = 0;
  int recomputed_halves = 0;
  int recomputed_blocks_in_halves = 0;  // whole, their backward in halves (the same)
  bool optimizer_state_on_host = false;  // the policy's last step (recompute_policy.h)
  uint64_t optimizer_state_host_bytes = 0;  // how much of the state it moved there
  int offloaded_blocks = 0;  // blocks keeping their input in host memory (the same)
  int mlp_slices = 1;  // slices of the batch a recomputed MLP runs again in (the same)
  int sliced_mlps = 0;  // blocks whose MLP runs again so, from the last block on
  // The last progress reported, with its memory fields as they are at the
  // end (the peak then covers the final evaluation too); epoch 0 when this
  // run reported no progress (it resumed after its last epoch).
  JobProgress memory;
};

class JobCancelled : public std::runtime_error {
 public:
  JobCancelled() : std::runtime_error("job cancelled") {}
};

// Another replica of a data-parallel job is gone (its rendezvous or a
// collective failed or timed out): this replica's attempt is interrupted,
// not failed; the coordinator restarts the gang from its checkpoint.
class ReplicaLost : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct JobRunOptions {
  engine::Device device;
  // Where checkpoints are written and read (null: the real file system,
  // through the job's checkpoint folder opened and checked afresh at every
  // write and resume; shared/checkpoint_folder.h).
  FileSystem* file_system = nullptr;
  // Whose checkpoint folder it is (with the real file system).
  CheckpointOwner checkpoint_owner = CheckpointOwner::this_user();
  // Called once, before the first step, when the job resumes from the
  // checkpoint written after epoch `epoch`; on_epoch then reports that
  // epoch again (the run that wrote it may have died before reporting it).
  std::function<void(int64_t epoch)> on_resume;
  // Called at most every `progress_interval` (and at the end of each epoch).
  std::function<void(const JobProgress&)> on_progress;
  std::function<void(const EpochReport&)> on_epoch;
  std::chrono::milliseconds progress_interval{1000};
  // Asked between steps; when it returns true the job stops with
  // JobCancelled. Must be cheap (called every step).
  std::function<bool()> should_stop;
  // Called between steps, after should_stop: where the agent gives memory
  // back when the coordinator asks it to shrink. May be empty.
  std::function<void()> at_step_boundary;
  // Asked between steps, before at_step_boundary: true when the agent is
  // about to give memory back (a Shrink). The job then drops its step's
  // CUDA graph, whose pool holds a step's peak memory, so that the memory
  // can go, and runs its steps op by op for the rest of the attempt. May be
  // empty.
  std::function<bool()> memory_wanted;
  // Where saved tensors go when the budget cannot hold them (null: they
  // stay, and a job over its budget fails with out-of-memory).
  std::shared_ptr<spill::SpillManager> spill;
  // The agent's coordinator session, for shared cache regions: the dataset
  // is taken from (or put into) one, and the job's init_from and
  // publish_parameters use them. Null: the job keeps its data to itself,
  // and a spec naming a parameter region fails.
  AgentSession* session = nullptr;
  // Whether the dataset goes into a region (with a session); false: the
  // job decodes it into its own host memory.
  bool dataset_regions = true;
  // Called once, when the first training step begins (Unix microseconds).
  std::function<void(uint64_t unix_us)> on_first_step;
  // A data-parallel job: this replica (rank 0 evaluates, checkpoints,
  // reports and publishes; every replica trains on its shard of each
  // global batch, gradients averaged over all of them), the attempt's
  // secret for the replicas' rendezvous, and a thread-safe "the job is
  // being stopped" for waits on other replicas.
  Replica replica;
  std::string replica_token;
  std::function<bool()> stopping;
  // Whether a CUDA job's steps run as one CUDA graph each (engine/
  // step_graph.h) once its first step ran op by op; false: every step op by
  // op (the same results, more launches).
  bool cuda_graphs = true;
};

// Throws JobSpecError for a bad spec (or a model that does not fit the
// data), std::runtime_error for data or I/O failures (a parameter region
// that is absent or does not match the model names the region) (spill::SpillError when the spill store fails) (a checkpoint that cannot be written names the file and the
// error; the previous checkpoint stays intact), engine::OutOfMemoryError when
// the budget is too small, and JobCancelled.
JobResult run_job(const proto::JobSpec& job, const JobRunOptions& options);

}  // namespace leasehold
