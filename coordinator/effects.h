// What one call into the coordinator's core asks the transport to do: send
// messages, publish job events, write job rows, check job files, remove
// folders. The core decides; the transport (coordinator/broker.h) encodes,
// sends and performs the I/O, so the core never touches a socket, a file or
// the clock.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "schemas/leasehold_generated.h"
#include "shared/checkpoint_folder.h"
#include "shared/job_spec.h"

namespace leasehold {

// An event on the PUB socket that is not a job's state: `topic` (for
// example "shrink.agent-1.") and a message body.
struct Notice {
  std::string topic;
  proto::BodyUnion body;
};

// A reply (request_id of the request) or a push (request_id 0) to one socket.
struct OutMessage {
  std::string to;  // ZeroMQ routing id
  uint64_t request_id = 0;
  proto::BodyUnion body;
  // It acknowledges or acts on stored state (a submission, a cancel, a
  // result; an assignment): it leaves only once the call's store writes are
  // committed. Other messages (heartbeat acks, leases, status) leave at once.
  bool after_store = false;
  // Part of accepting this job (its JobAccepted, its assignment): while the
  // store cannot commit the job's row, the transport may withdraw the job
  // (CoordinatorCore::withdraw_submission) and drops these with it.
  uint64_t job = 0;
};

// Dataset files of a submitted job to check off the loop's thread (they may
// sit on a slow or hung file system).
struct FileCheck {
  uint64_t token = 0;
  std::shared_ptr<const proto::JobSpecT> spec;
  ValidationOptions validation;  // the submission's, with check_files on
};

// A piece of a job's checkpoint file, for its owner, to read off the loop's
// thread (the folder may be the submitter's own, on a slow file system).
struct CheckpointRead {
  uint64_t token = 0;
  std::string dir, name;
  CheckpointOwner owner;  // whose folder it is: checked as the agents check it
  uint64_t offset = 0;
};

// Chunks of a device's pool to give new memory (DevicePool::renew) off the
// loop's thread (CoordinatorCore::take_chunk_renewals): lease `lease_id`,
// held by LeaseOwner::renewing, covers them until
// CoordinatorCore::chunks_renewed hears they are done.
struct ChunkRenewal {
  int device = 0;  // the device's ordinal
  uint64_t lease_id = 0;
  uint64_t first = 0, count = 0;  // chunks
};

struct Effects {
  std::vector<OutMessage> messages;
  // Jobs whose state is published (their state at the end of the call).
  std::vector<uint64_t> events;
  // Jobs whose stored row must be rewritten, and jobs to delete from the
  // store. Events and after_store messages of a call that writes are
  // released only once the write is committed, so nobody learns a state a
  // crash could undo.
  std::set<uint64_t> store_puts;
  std::vector<uint64_t> store_deletes;
  std::vector<FileCheck> file_checks;
  std::vector<CheckpointRead> checkpoint_reads;
  // Folders to delete (checkpoints of pruned jobs).
  std::vector<std::string> remove_dirs;
  // Other events (shrink requests and answers); they leave at once.
  std::vector<Notice> notices;

  bool writes_store() const { return !store_puts.empty() || !store_deletes.empty(); }
  bool empty() const {
    return messages.empty() && events.empty() && !writes_store() && file_checks.empty() &&
           checkpoint_reads.empty() && remove_dirs.empty() && notices.empty();
  }
};

}  // namespace leasehold
