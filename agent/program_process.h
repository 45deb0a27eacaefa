// A program job's process (JobSpec.program): the agent starts its command as
// a child in a process group of its own, with the environment that lets
// the PyTorch plug-in find the job's session (docs/program-jobs.md), turns
// its standard output and error into the job's log and the lines it writes
// to its report pipe (leasehold.report()) into progress, stops it with
// SIGTERM and then SIGKILL when asked, and leaves nothing of it behind: the
// group is killed when the program ends, and the child gets SIGKILL if the
// agent dies first (PR_SET_PDEATHSIG). A grandchild that leaves the group
// (setsid) escapes that last kill; docs/program-jobs.md says so.
//
// Thread safety: run_program blocks its caller until the program has ended;
// the callbacks run on that thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "schemas/leasehold_generated.h"

namespace leasehold {

// One line the program wrote to its report pipe ({"type": "report", ...}).
struct ProgramReport {
  std::optional<int64_t> step, epoch, samples;
  std::optional<double> loss, test_accuracy;
};

struct ProgramRun {
  // Variables the agent sets (LEASEHOLD_*, CUDA_MPS_PIPE_DIRECTORY,
  // PYTHONPATH's leading folders), over the agent's own environment and
  // under none of the job's (validated not to name them).
  std::map<std::string, std::string> environment;
  // Folders put first on PYTHONPATH (the plug-in's sitecustomize and the
  // leasehold package), before the job's or the agent's PYTHONPATH.
  std::vector<std::string> python_path;
  // How long after SIGTERM the group gets SIGKILL.
  std::chrono::milliseconds stop_grace{10000};
  // Asked about every 100 ms; true: stop the program (cancel, a lost
  // session, the agent stopping).
  std::function<bool()> should_stop;
  // Output as it comes (standard output and error interleaved as read):
  // `offset` is the bytes of this run's output before `chunk`.
  std::function<void(std::string_view chunk, uint64_t offset)> on_output;
  std::function<void(const ProgramReport&)> on_report;
  std::function<void(const proto::ProgramMemoryT&)> on_memory;
  // Called once the child runs (its pid), before any output.
  std::function<void(int pid)> on_start;
};

struct ProgramOutcome {
  // Exit status: the program's, or 128 + the signal that ended it.
  int exit_code = 0;
  bool stopped = false;       // should_stop asked it to end
  std::string stderr_tail;    // the last lines of its standard error
  uint64_t output_bytes = 0;  // of standard output and error together
};

// Starts `job`'s program and waits for it. Throws std::runtime_error when
// it cannot be started (a command that is not found or not executable, a
// directory that cannot be entered: the message names it).
ProgramOutcome run_program(const proto::ProgramSpec& program, const ProgramRun& run);

// Parses one report line; nullopt (with the reason in `why`) for one that
// is not a valid report or memory line. Memory lines fill `memory`.
std::optional<ProgramReport> parse_report_line(std::string_view line, std::string& why,
                                               std::optional<proto::ProgramMemoryT>& memory);

}  // namespace leasehold
