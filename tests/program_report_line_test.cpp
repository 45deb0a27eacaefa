// The lines a program job writes to its agent (python/leasehold/__init__.py:
// report() and the memory lines after it), as agent/program_process parses
// them: every field of a memory line reaches ProgramMemory, and a bad line
// is refused with the reason while the memory already read is kept.
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "agent/program_process.h"

namespace leasehold {
namespace {

TEST(ProgramReportLine, AMemoryLineFillsEveryField) {
  std::string why;
  std::optional<proto::ProgramMemoryT> memory;
  auto r = parse_report_line(
      R"({"type": "memory", "leased_bytes": 1000, "peak_leased_bytes": 1001,)"
      R"( "in_use_bytes": 1002, "peak_in_use_bytes": 1003, "allocations": 1004,)"
      R"( "cache_hits": 1005, "lease_requests": 1006, "spilled_bytes": 1007,)"
      R"( "restored_bytes": 1008})",
      why, memory);
  ASSERT_TRUE(r.has_value()) << why;
  ASSERT_TRUE(memory.has_value());
  EXPECT_EQ(memory->leased_bytes, 1000u);
  EXPECT_EQ(memory->peak_leased_bytes, 1001u);
  EXPECT_EQ(memory->in_use_bytes, 1002u);
  EXPECT_EQ(memory->peak_in_use_bytes, 1003u);
  EXPECT_EQ(memory->allocations, 1004u);
  EXPECT_EQ(memory->cache_hits, 1005u);
  EXPECT_EQ(memory->lease_requests, 1006u);
  EXPECT_EQ(memory->spilled_bytes, 1007u);
  EXPECT_EQ(memory->restored_bytes, 1008u);
}

TEST(ProgramReportLine, AMemoryLineWithoutSpillingCountsNone) {
  // A package from before spilling sends no spilled_bytes.
  std::string why;
  std::optional<proto::ProgramMemoryT> memory;
  ASSERT_TRUE(parse_report_line(R"({"type": "memory", "leased_bytes": 5})", why, memory))
      << why;
  ASSERT_TRUE(memory.has_value());
  EXPECT_EQ(memory->leased_bytes, 5u);
  EXPECT_EQ(memory->spilled_bytes, 0u);
  EXPECT_EQ(memory->restored_bytes, 0u);
}

TEST(ProgramReportLine, BadMemoryFieldsAreRefusedByNameAndKeepWhatWasRead) {
  std::string why;
  std::optional<proto::ProgramMemoryT> memory;
  ASSERT_TRUE(parse_report_line(R"({"type": "memory", "spilled_bytes": 7})", why, memory));
  for (const char* line : {R"({"type": "memory", "spilled_bytes": -1})",
                           R"({"type": "memory", "spilled_bytes": "lots"})",
                           R"({"type": "memory", "spilled_bytes": 1.5})"}) {
    why.clear();
    EXPECT_FALSE(parse_report_line(line, why, memory)) << line;
    EXPECT_NE(why.find("spilled_bytes"), std::string::npos) << line << ": " << why;
    ASSERT_TRUE(memory.has_value());
    EXPECT_EQ(memory->spilled_bytes, 7u) << line;  // the last good line's
  }
}

}  // namespace
}  // namespace leasehold
