// Program jobs (JobSpec.program): the checks of their fields, and the
// environment the agent reserves for itself. See docs/program-jobs.md.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "shared/job_spec.h"

namespace leasehold {

// At most this many arguments, environment entries.
inline constexpr size_t kMaxProgramArguments = 1024;
inline constexpr size_t kMaxProgramEnvironment = 256;

// Appends to `problems` what is wrong with `job`'s program: the command (a
// non-empty list of plain strings), the directory (absolute; with
// check_files, a folder the submitter may read and enter), the environment
// (names of letters, digits and '_', none the agent sets), and any field
// of an engine job (model, dataset, optimizer, epochs, steps, spill,
// parameter regions), which a program job does not have.
void validate_program(const proto::JobSpec& job, const ValidationOptions& options,
                      std::vector<std::string>& problems);

// Whether the agent sets `name` for a program job's process (LEASEHOLD_*,
// the MPS variables): a job's environment may not.
bool reserved_environment_name(std::string_view name);

}  // namespace leasehold
