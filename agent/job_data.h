// A job's dataset, decoded and normalised. In an agent with a coordinator
// session it lives in a shared cache region named after what determines
// its bytes: the first job on the data decodes the files and fills the
// region; every later job, on any agent, attaches and uses it in place (on
// the device with the cuda backend, so batches are gathered there). Without
// a session, or when no region can be had, the job decodes into its own
// host memory as before.
#pragma once

#include <memory>
#include <string>

#include "agent/engine/data.h"
#include "lease_client/session.h"
#include "schemas/job_generated.h"

namespace leasehold {

struct JobData {
  engine::data::Dataset train, test;
  std::string region;    // the region holding it; empty: the job's own memory
  bool decoded = false;  // this job read and decoded the files
  std::string private_because;  // why no region holds it (empty when one does)
};

// "dataset/", the training images' folder and file name (for people), and
// a hash of what determines the decoded bytes: each file's
// path, device, inode, size and modification time; mean, std and the
// limits; the layout (float32 [N,1,H,W] images, int64 labels). Only stats
// the files. Throws std::runtime_error naming a file that cannot be stat'ed.
std::string dataset_region_name(const proto::JobSpec& job);

// The job's data, from or into its region when `session` is set (null:
// the job's own host memory). Throws
// std::runtime_error naming the file for missing or malformed files, or
// the region when it does not hold a dataset.
JobData load_job_data(const proto::JobSpec& job, AgentSession* session);

}  // namespace leasehold
