// Job records as the protocol's JobInfo: for replies (summaries in lists and
// events, the full record for `leasehold job`), and as the bytes of a job's
// row in the store (everything, so a restart restores the job exactly).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "coordinator/job_table.h"
#include "schemas/leasehold_generated.h"

namespace leasehold {

// How much of a job goes into a JobInfo. Lists and events carry only the
// latest epochs, history and attempts so that a page of many jobs stays far
// below the protocol's message size; epochs_total and history_total say how
// many there are, and the latest attempt's number how many attempts.
struct InfoDetail {
  bool spec = false;
  size_t max_epochs = SIZE_MAX;
  size_t max_history = SIZE_MAX;
  size_t max_attempts = SIZE_MAX;
  // A program job's environment values (tokens, keys) are its submitter's:
  // others, and the HTTP views, see the names with kHiddenValue.
  bool environment_values = false;
};
inline constexpr const char* kHiddenValue = "(hidden: only its submitter sees it)";
inline constexpr InfoDetail kSummaryDetail{false, 20, 10, 5};
// A job event says how the job progresses: its state, progress and the
// latest epochs (for followers that print each), not its whole record.
inline constexpr InfoDetail kEventDetail{false, 3, 1, 1};
inline constexpr InfoDetail kFullDetail{true, 10000, 1000, 1000};
inline constexpr InfoDetail kOwnersDetail{true, 10000, 1000, 1000, true};
// A page of job summaries ends once it holds this many bytes.
inline constexpr size_t kListPageBytes = 1u << 20;

std::unique_ptr<proto::JobInfoT> job_info(const JobRecord& job, const InfoDetail& detail);

// A job's stored row: a JobInfo buffer holding everything.
std::vector<uint8_t> encode_job(const JobRecord& job);
// Throws std::runtime_error naming the job when `bytes` is not a valid row.
JobRecord decode_job(uint64_t id, std::span<const uint8_t> bytes);

}  // namespace leasehold
