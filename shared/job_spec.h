// Job specifications: parsing JSON job files against schemas/job.fbs,
// checking the values, and resolving defaults. The client checks a job
// before submitting it and the coordinator and agent check it again.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "schemas/job_generated.h"

namespace leasehold {

// A FlatBuffers string's text; `fallback` where the field is absent.
inline std::string str_or(const flatbuffers::String* s, const std::string& fallback = "") {
  return s ? s->str() : fallback;
}

// Thrown with every problem found, each naming the field ("epochs: must be
// positive", "model[3].in: ...").
class JobSpecError : public std::invalid_argument {
 public:
  explicit JobSpecError(const std::vector<std::string>& problems);
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  std::vector<std::string> problems_;
};

// Parses JSON text into a verified JobSpec FlatBuffer. Unknown fields and
// wrong types are errors naming the field and the line. `source` names the
// text in messages (the file name).
std::vector<uint8_t> parse_job_json(const std::string& json, const std::string& source);
// Verifies a JobSpec buffer received over the wire. Throws JobSpecError.
const proto::JobSpec* verify_job(const std::vector<uint8_t>& buffer);
// `spec` as a standalone, finished JobSpec buffer (for verify_job).
std::vector<uint8_t> pack_job_spec(const proto::JobSpecT& spec);

// Resolved dataset files and shapes.
struct DatasetFiles {
  std::string train_images, train_labels, test_images, test_labels;
};
DatasetFiles dataset_files(const proto::JobSpec& job);

// A language model's corpus: dataset.name "text" (docs/jobs.md).
bool is_text_dataset(const proto::JobSpec& job);
// Tokens a text sample holds at most, and the vocabulary (bytes).
inline constexpr int64_t kMaxTextContext = 8192;
inline constexpr int64_t kTextVocabulary = 256;
// Bytes a token of a text corpus takes in a job's memory: the corpus is
// held as its bytes, and only a batch's samples are made as int64 tokens
// and targets (engine/data.h).
inline constexpr uint64_t kTextBytesPerToken = 1;

// The coordinator's limits on one job's length (its options max_epochs
// and max_steps, named in the error a job over them gets).
struct JobLengthLimits {
  int64_t max_epochs = 100000;
  int64_t max_steps = 1000000000;
  // No limit but the field's range: for an agent running a job the
  // coordinator already accepted under its own limits.
  static JobLengthLimits none() { return {INT64_MAX, INT64_MAX}; }
};

struct ValidationOptions {
  // (A constructor rather than an aggregate: callers name the leading
  // options they need, and the rest keep their defaults without warnings.)
  ValidationOptions(bool check_files = true, uint64_t pool_bytes = 0, JobLengthLimits limits = {},
                    std::string reserved_dir = {})
      : check_files(check_files),
        pool_bytes(pool_bytes),
        limits(limits),
        reserved_dir(std::move(reserved_dir)) {}

  bool check_files;     // the dataset files exist and have IDX headers
  uint64_t pool_bytes;  // when set, the memory budget must fit the pool
  // When set, the pool's lease alignment: a budget must hold at least one
  // lease, and the model's resident state in whole leases.
  uint64_t alignment = 0;
  JobLengthLimits limits;  // the coordinator's
  // With check_files: a folder a job's checkpoint directory may not be in
  // (the coordinator's state folder, which holds other jobs' checkpoints).
  std::string reserved_dir;
  // With check_files: the submitter's uid (-1: not known), who must own a
  // checkpoint folder the job names (shared/checkpoint_folder.h).
  int64_t submitter_uid = -1;
  int64_t submitter_gid = -1;  // their primary group (-1: not known)
};

// Every problem with the values: sizes, hyper-parameters, layers that do not
// chain (shapes inferred from the dataset's image size), files. Throws
// JobSpecError listing them all.
void validate_job(const proto::JobSpec& job, const ValidationOptions& options);
void validate_job(const proto::JobSpecT& job, const ValidationOptions& options);
// That the model's layers chain from one example of shape `input` ([C, H,
// W], or [T] tokens of a text dataset) to class scores (next-token scores
// [T, 256] for text). Throws JobSpecError naming the layer.
void validate_model(const proto::JobSpec& job, const std::vector<int64_t>& input);

// The checkpoint file of a job: DIRECTORY/NAME.ckpt; empty when checkpoints
// are disabled or no directory is set (the coordinator sets one for every
// job it queues; `leasehold-agent --run-job` uses the file's).
std::string checkpoint_file(const proto::JobSpec& job);
std::string checkpoint_file(const proto::JobSpecT& job);

// The memory budget in bytes. Unset: 1 GiB, or the whole pool when
// `pool_bytes` is known and smaller.
uint64_t job_memory_budget(const proto::JobSpec& job, uint64_t pool_bytes = 0);

// The guaranteed share: memory_min, or the budget when it is not set (the
// job then never grows past its guarantee). Throws on a malformed size.
uint64_t job_memory_min(const proto::JobSpec& job, uint64_t pool_bytes = 0);

// Bytes that stay on the device for the whole job, whatever spills: the
// parameters, their gradients and the optimiser's state (float32).
uint64_t job_resident_bytes(const proto::JobSpec& job);

// A job's `device`: the backend it wants ("auto", "cuda" or "cpu") and the
// device it pins, if any ("cuda:1", "cpu:0": ordinal 1, 0 of the
// coordinator's devices). nullopt when the text is none of these.
struct JobDevice {
  std::string backend = "auto";
  std::optional<int> ordinal;
};
std::optional<JobDevice> parse_job_device(std::string_view text);

// A data-parallel job's replicas (JobSpec.replicas): at most this many.
inline constexpr int kMaxReplicas = 64;

// spill.host_bytes: the most of the agent's spill host tier the job may use
// (0 when absent, meaning all of it; an explicit "0" means none).
uint64_t job_spill_host_bytes(const proto::JobSpec& job);

}  // namespace leasehold
