// A job's checkpoint, fetched by its owner: the coordinator reads the file
// its agents wrote (in the job's private folder, 0700, or a folder of the
// submitter's own) and hands it over in pieces to the job's submitter and
// administrators only, so that nobody else needs to read the state folder.
// The reading is done by the file workers (coordinator/file_workers.h): a
// folder on a slow file system holds up one of them, never the loop.
#include <filesystem>

#include "coordinator/core.h"
#include "coordinator/replies.h"
#include "shared/protocol.h"

namespace leasehold {

void CoordinatorCore::on_get_checkpoint(const std::string& rid, const proto::Envelope& env, Now now,
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
    return send_error(
        out, rid, req, ErrorCode::InvalidArgument,
        "job " + std::to_string(job->id) + " keeps no checkpoint (checkpoints are off)");
  }
  const std::filesystem::path file(job->checkpoint);
  CheckpointRead read;
  read.token = next_check_token_++;
  read.dir = file.parent_path().string();
  read.name = file.filename().string();
  read.owner = CheckpointOwner{read.dir == private_checkpoint_dir(job->id),
                               job->submitted_uid ? int64_t(*job->submitted_uid) : -1};
  read.offset = g->offset();
  pending_reads_[read.token] = PendingRead{rid,
                                           req,
                                           job->id,
                                           read.name,
                                           job->last_checkpoint_epoch(),
                                           read.offset,
                                           now.steady + opts_.file_check_timeout};
  out.checkpoint_reads.push_back(std::move(read));
}

void CoordinatorCore::checkpoint_read_done(const FileWorkers::ReadResult& r, Effects& out) {
  auto it = pending_reads_.find(r.token);
  if (it == pending_reads_.end()) return;  // answered already (it took too long)
  const PendingRead p = std::move(it->second);
  pending_reads_.erase(it);
  const std::string job = "job " + std::to_string(p.job_id);
  if (!r.ok) {
    if (r.refused) {
      return send_error(out, p.routing_id, p.request_id, ErrorCode::PermissionDenied,
                        "the checkpoint folder of " + job + " is refused: " + r.error);
    }
    if (r.missing) {
      return send_error(out, p.routing_id, p.request_id, ErrorCode::InvalidArgument,
                        job + " has no checkpoint yet (one is written after its first epoch)");
    }
    return send_error(out, p.routing_id, p.request_id, ErrorCode::Internal,
                      "cannot read the checkpoint of " + job + ": " + r.error);
  }
  proto::CheckpointDataT data;
  data.job_id = p.job_id;
  data.name = p.name;
  data.epoch = p.epoch;
  data.offset = p.offset;
  data.total = r.total;
  data.version = r.version;
  data.data.assign(r.data.begin(), r.data.end());
  send(out, p.routing_id, p.request_id, std::move(data));
}

void CoordinatorCore::expire_checkpoint_reads(Now now, Effects& out) {
  for (auto it = pending_reads_.begin(); it != pending_reads_.end();) {
    if (it->second.deadline > now.steady) {
      ++it;
      continue;
    }
    send_error(out, it->second.routing_id, it->second.request_id, ErrorCode::Timeout,
               "reading the checkpoint of job " + std::to_string(it->second.job_id) +
                   " took longer than " + std::to_string(opts_.file_check_timeout.count()) +
                   " ms (is its folder on a hung file system?)");
    it = pending_reads_.erase(it);
  }
}

}  // namespace leasehold
