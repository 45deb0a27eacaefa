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
// A program is started (start_program) and then supervised until it ends
// (supervise); run_program does both. A warm standby (agent/python_standby.h)
// is started long before its job and supervised once it has one.
//
// Thread safety: supervise and run_program block their caller until the
// program has ended; the callbacks run on that thread. A ProgramChild
// belongs to one thread at a time.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
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

// What start_program runs: `exe` (a path) with `argv` and `env` in `dir`.
struct ProgramLaunch {
  std::string exe, dir;
  std::vector<std::string> argv, env;
  bool control_pipe = false;  // give the child a pipe to read on its fd 4
};

// A started program: its process (the leader of its own group) and the
// agent's ends of its pipes. Destroying one that has not been reaped kills
// its group with SIGKILL and reaps it: a child never outlives its owner.
class ProgramChild {
 public:
  ProgramChild() = default;
  ProgramChild(ProgramChild&& o) noexcept { *this = std::move(o); }
  ProgramChild& operator=(ProgramChild&& o) noexcept;
  ProgramChild(const ProgramChild&) = delete;
  ProgramChild& operator=(const ProgramChild&) = delete;
  ~ProgramChild() { kill_and_reap(); }

  explicit operator bool() const { return pid_ > 0; }
  int pid() const { return pid_; }
  // The agent's ends (non-blocking): standard output, standard error, the
  // report pipe (the child's fd 3) and, when asked for, the control pipe
  // the agent writes to (the child's fd 4); -1 where there is none.
  int output_fd() const { return out_; }
  int error_fd() const { return err_; }
  int report_fd() const { return rep_; }
  int control_fd() const { return ctl_; }
  // Closes the control pipe (the child sees its end of file).
  void close_control();
  // True once the process has exited (it is reaped then, and its group
  // killed); never blocks.
  bool exited();
  // Its exit status once exited(): the program's, or 128 + the signal.
  int exit_code() const;

 private:
  friend ProgramChild start_program(const ProgramLaunch&);
  friend ProgramOutcome supervise(ProgramChild&, const ProgramRun&);
  void kill_and_reap();
  void close_fds();
  int pid_ = -1, pidfd_ = -1, out_ = -1, err_ = -1, rep_ = -1, ctl_ = -1;
  bool reaped_ = false;
  int status_ = 0;
};

// Starts a program: its own process group, standard input /dev/null,
// standard output and error and fd 3 on pipes, SIGKILL when the agent
// dies. Throws std::runtime_error when it cannot (fork, pipes; a folder
// that cannot be entered ends the child with status 127 and a line on its
// standard error).
ProgramChild start_program(const ProgramLaunch& launch);

// The environment a program gets, as NAME=VALUE: the agent's own without
// the names it reserves (shared/program_spec.h), then the job's variables
// (`program`; may be null), then `run.environment`; PYTHONPATH led by
// `run.python_path`. `path_var` gets the PATH in it.
std::vector<std::string> program_environment(const proto::ProgramSpec* program,
                                             const ProgramRun& run, std::string& path_var);

// The path of the program `name`: one with a '/' relative to `dir`, a bare
// name looked up on `path_var`. Throws std::runtime_error naming it when it
// is not an executable file.
std::string find_program(const std::string& name, const std::string& dir,
                         const std::string& path_var);

// Reads a started program's output and reports, stops it when
// run.should_stop asks, and returns once it has ended (its group killed,
// its pipes drained).
ProgramOutcome supervise(ProgramChild& child, const ProgramRun& run);

// Starts `program` (find_program, program_environment, start_program) and
// supervises it. Throws std::runtime_error when it cannot be started (a
// command that is not found or not executable, a directory that cannot be
// entered: the message names it).
ProgramOutcome run_program(const proto::ProgramSpec& program, const ProgramRun& run);

// Parses one report line; nullopt (with the reason in `why`) for one that
// is not a valid report or memory line. Memory lines fill `memory`.
std::optional<ProgramReport> parse_report_line(std::string_view line, std::string& why,
                                               std::optional<proto::ProgramMemoryT>& memory);

}  // namespace leasehold
