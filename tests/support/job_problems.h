// What a job file's parsing or validation refuses: the text of the
// JobSpecError that `f` throws, or "" when it throws none. The job tests
// read every refusal this way.
#pragma once

#include <functional>
#include <string>

#include "shared/job_spec.h"

namespace leasehold::testing {

inline std::string problems_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const JobSpecError& e) {
    return e.what();
  }
  return "";
}

}  // namespace leasehold::testing
