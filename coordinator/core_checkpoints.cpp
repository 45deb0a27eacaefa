// A job's checkpoint, fetched by its owner: the coordinator reads the file
// its agents wrote (in the job's private folder, 0700, or a folder of the
// submitter's own) and hands it over in pieces to the job's submitter and
// administrators only, so that nobody else needs to read the state folder.
#include <spdlog/spdlog.h>

#include <filesystem>

#include "coordinator/core.h"
#include "coordinator/replies.h"
#include "shared/checkpoint_folder.h"
#include "shared/protocol.h"

namespace leasehold {
namespace {

// One answer's share of the file: far below the protocol's message size.
constexpr size_t kCheckpointChunkBytes = 1u << 20;

}  // namespace

void CoordinatorCore::on_get_checkpoint(const std::string& rid, const proto::Envelope& env,
                                        Effects& out, const Peer& peer) {
  const uint64_t req = env.header()->request_id();
  const auto* g = env.body_as_GetCheckpoint();
  const JobRecord* job = jobs_.find(g->job_id());
  if (!job) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "no job with id " + std::to_string(g->job_id()));
  }
  if (auto no = owner_refusal(*job, peer, "fetch the checkpoint of")) {
    return send_error(out, rid, req, ErrorCode::PermissionDenied, *no);
  }
  if (job->is_program()) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "job " + std::to_string(job->id) +
                          " is a program job: its checkpoint folder holds whatever the program "
                          "wrote there (LEASEHOLD_CHECKPOINT_DIR); read it as the program does");
  }
  if (job->checkpoint.empty()) {
    return send_error(out, rid, req, ErrorCode::InvalidArgument,
                      "job " + std::to_string(job->id) + " keeps no checkpoint (checkpoints are off)");
  }
  const std::filesystem::path file(job->checkpoint);
  const std::string dir = file.parent_path().string();
  // Opened as the agents open it: no link anywhere on the way, the folder's
  // owner checked (the job's private folder, or its submitter's own).
  const CheckpointOwner owner{dir == private_checkpoint_dir(job->id),
                              job->submitted_uid ? int64_t(*job->submitted_uid) : -1};
  proto::CheckpointDataT data;
  data.job_id = job->id;
  data.name = file.filename().string();
  data.epoch = job->last_checkpoint_epoch();
  std::string bytes;
  Status st = Status::OK();
  try {
    CheckpointFolder folder(dir, owner, /*create=*/false);
    st = folder.read_range(data.name, g->offset(), kCheckpointChunkBytes, &bytes, &data.total);
  } catch (const std::system_error& e) {
    if (e.code() != std::errc::no_such_file_or_directory) {
      return send_error(out, rid, req, ErrorCode::Internal,
                        "cannot open the checkpoint folder of job " + std::to_string(job->id) +
                            ": " + e.what());
    }
    st = Status::not_found("no folder");
  } catch (const std::exception& e) {
    return send_error(out, rid, req, ErrorCode::PermissionDenied,
                      "the checkpoint folder of job " + std::to_string(job->id) +
                          " is refused: " + e.what());
  }
  if (!st.ok()) {
    if (data.epoch <= 0) {
      return send_error(out, rid, req, ErrorCode::InvalidArgument,
                        "job " + std::to_string(job->id) +
                            " has no checkpoint yet (one is written after its first epoch)");
    }
    return send_error(out, rid, req, ErrorCode::Internal,
                      "cannot read the checkpoint of job " + std::to_string(job->id) + ": " +
                          st.message());
  }
  data.offset = g->offset();
  data.data.assign(bytes.begin(), bytes.end());
  send(out, rid, req, std::move(data));
}

}  // namespace leasehold
