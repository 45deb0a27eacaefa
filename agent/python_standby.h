// Warm standbys for Python program jobs (--python-standby N;
// docs/program-jobs.md). The agent keeps N `python3 -m leasehold.standby`
// processes started ahead of any job (python/leasehold/standby.py): torch
// imported, the plug-in installed as PyTorch's allocator, and in the
// default `process` mode the CUDA context created and one small training
// step run (cuBLAS and cuDNN handles, common kernels loaded) in memory that
// is freed again before any job. A program job whose command is
// `PYTHON SCRIPT ARG...` or `PYTHON -m MODULE ARG...`, with the standby's
// interpreter and no variable of its own that Python, PyTorch or CUDA read
// at start-up, is handed to a ready standby: its whole environment (what a
// cold start of it gets), folder and arguments on the standby's control
// pipe. The standby runs it (runpy) and ends with it; a new one replaces
// it. Anything else runs cold, as before.
//
// Thread safety: one thread (the agent's job worker) uses an object.
#pragma once

#include <chrono>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "agent/program_process.h"

namespace leasehold {

struct PythonStandbyOptions {
  int count = 0;                   // standbys kept ready; 0: none
  std::string python = "python3";  // the interpreter: a path, or a name on the agent's PATH
  std::string mode = "process";    // "process" (the job runs in the standby) or "fork"
  std::string preload;             // modules imported while warming up (comma-separated)
};

// A job's command as a standby runs it.
struct WarmCommand {
  std::vector<std::string> argv;  // sys.argv: the script (or the module's name) first
  std::optional<std::string> module;
};

// Whether `command` (with `interpreter`, the path the job's command[0]
// resolves to) can run in a standby of `standby_python`; its form when it
// can, else nullopt with the reason in `why`. `job_variables` are the names
// the job's environment sets.
std::optional<WarmCommand> warm_command(const std::vector<std::string>& command,
                                        const std::string& interpreter,
                                        const std::string& standby_python,
                                        const std::vector<std::string>& job_variables,
                                        std::string& why);

// Whether Python, PyTorch, CUDA or a library they load reads `name` at
// start-up (PYTHON*, LD_*, CUDA_*, TORCH*, ...): a job that sets one runs
// cold, where it takes effect.
bool startup_variable(const std::string& name);

class PythonStandbys {
 public:
  // `base`: the environment and Python path every program job of this
  // agent gets (none of a job's own). Finds the interpreter; with none,
  // logs why and keeps no standbys.
  PythonStandbys(PythonStandbyOptions options, ProgramRun base);
  PythonStandbys(const PythonStandbys&) = delete;
  PythonStandbys& operator=(const PythonStandbys&) = delete;

  // Reaps standbys that ended, passes their output to the agent's log and
  // starts new ones up to the count (after a standby failed to warm up, not
  // for a minute). Never blocks.
  void fill();
  // A ready standby running `program` (its job line sent), or an empty
  // child with the reason it runs cold in `why`. `run` is the job's (its
  // environment complete). Throws std::runtime_error as run_program does
  // for a folder that is not there.
  ProgramChild take(const proto::ProgramSpec& program, const ProgramRun& run, std::string& why);

  int ready() const;
  const std::string& python() const { return python_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Standby {
    ProgramChild child;
    std::string reports;  // its report pipe's bytes, up to the ready line
    bool ready = false;
    Clock::time_point started;
  };
  // Reads its output (to the log) and report pipe; false once it ended.
  bool poll(Standby& s);

  PythonStandbyOptions options_;
  ProgramRun base_;
  std::string python_;  // the interpreter's path, as found ("": none)
  std::deque<Standby> standbys_;
  std::optional<Clock::time_point> paused_until_;
};

}  // namespace leasehold
