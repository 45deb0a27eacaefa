// Renders jobs for the client: JSON (stable field names), tables and
// progress lines.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "schemas/leasehold_generated.h"

namespace leasehold {

// Field names are a stable interface (see README): attempts is the number of
// runs so far, attempt_history lists them.
nlohmann::json job_to_json(const proto::JobInfo& job);
// One row per job: id, name, state, attempts, agent, progress, age.
std::string jobs_to_table(const std::vector<const proto::JobInfo*>& jobs);
// Spec summary, state history, attempts, per-epoch metrics and result.
std::string job_to_text(const proto::JobInfo& job);
// "epoch 3/10 [#####.....] 234/469 loss 0.4123 20345 samples/s ETA 12s"
// (bar only when `bar`).
std::string progress_line(const proto::JobInfo& job, bool bar);
// A succeeded job's result: its test accuracy and throughput, or a program's
// exit status where it reported no accuracy.
std::string result_summary(const proto::JobInfo& job);
// An epoch's figures: "train loss 1.2345, test accuracy 91.20%", or for a
// text job "train loss 1.2345, validation loss 1.3012 (1.877 bits/byte),
// next-token accuracy 61.50%".
std::string epoch_figures(const proto::EpochStat& epoch);

}  // namespace leasehold
