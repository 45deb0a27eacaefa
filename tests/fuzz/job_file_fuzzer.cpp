// libFuzzer target: the job-file parser and validator (shared/job_spec.h),
// which reads what any local user submits. Whatever the text, it returns a
// job or throws JobSpecError naming the problem; nothing else escapes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "shared/job_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    auto buffer = leasehold::parse_job_json(text, "fuzz.json");
    const auto* job = leasehold::verify_job(buffer);
    // Without touching files: the shapes, sizes and names only.
    leasehold::validate_job(*job, leasehold::ValidationOptions{false, 1ull << 30});
  } catch (const leasehold::JobSpecError&) {
  }
  return 0;
}
