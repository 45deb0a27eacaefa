// The JSON the HTTP endpoint serves, rendered by the loop from the core with
// the client's own renderers (client/status_format.h, client/job_format.h):
// /api/status is byte for byte what `leasehold status -o json` prints, and
// a job what `leasehold job ID -o json` prints.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "coordinator/effects.h"
#include "coordinator/job_table.h"

namespace leasehold {

std::string render_status_json(const proto::StatusReplyT& status);

// A job as `leasehold jobs -o json` lists it (summary) and as `leasehold job
// ID -o json` shows it (full detail): plain objects the loop copies out of
// the core; the JSON is rendered on the HTTP thread that serves it.
struct JobViews {
  uint64_t id = 0;
  std::shared_ptr<const proto::JobInfoT> summary, full;
};
JobViews job_views(const JobRecord& job);
std::string render_job_json(const proto::JobInfoT& info);

// What the PUB socket carries, as one server-sent event's data line:
// {"topic": "job.7.", "job": {...}} for a job's change, and
// {"topic": "shrink.a1.", "shrink": {...}} / {"topic": ..., "shrink_done": {...}}
// for the policy's notices (without the agent's session token).
std::string render_job_event(const JobRecord& job);
std::string render_notice_event(const Notice& notice);

}  // namespace leasehold
