// Renders jobs for the client: JSON (stable field names), tables and
// progress lines.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "schemas/leasehold_generated.h"

namespace leasehold {

nlohmann::json job_to_json(const proto::JobInfo& job);
// One row per job: id, name, state, agent, progress, age.
std::string jobs_to_table(const proto::JobList& list);
// Spec summary, state history, per-epoch metrics and result.
std::string job_to_text(const proto::JobInfo& job);
// "epoch 3/10 [#####.....] 234/469 loss 0.4123 20345 samples/s ETA 12s"
// (bar only when `bar`).
std::string progress_line(const proto::JobInfo& job, bool bar);

}  // namespace leasehold
