// An agent's process as the coordinator follows it. An agent connected over
// ipc:// is a local process the kernel named (SO_PEERCRED); the coordinator
// opens a pidfd for it when it registers, so that every later question (has
// it exited?) and the SIGKILL that ends a hung agent reach that process and
// no other, even once its pid is reused.
//
// Why it matters: an agent that falls silent while its process lives (a
// SIGSTOP, a debugger, a VM pause, swapping) may write into its leases the
// moment it runs again. Its memory is given to nobody until the process has
// exited; the coordinator may end it to get there (core.h, end_silent_agents).
#pragma once

#include <sys/types.h>

#include <memory>
#include <string>

namespace leasehold {

class AgentProcess {
 public:
  virtual ~AgentProcess() = default;
  virtual int pid() const = 0;
  // The process has exited (a zombie counts: its memory, device context and
  // mappings went with its exit).
  virtual bool gone() const = 0;
  // The process is stopped (SIGSTOP, a tracer): it runs nothing, so its
  // silence is no slow host's and its leases are fenced at once. False
  // when it runs, sleeps or has exited, or when the kernel cannot say.
  virtual bool stopped() const = 0;
  // Sends it SIGKILL. Empty when sent (or it was gone already), else why the
  // coordinator cannot end it (another user's process, no permission).
  virtual std::string end() = 0;
};

// Follows the local process `pid`, run by `uid` as the kernel said. The
// coordinator ends only processes of its own user. Null when `pid` is not
// positive; a process already gone gives an object that says so.
std::shared_ptr<AgentProcess> follow_process(pid_t pid, uid_t uid);

}  // namespace leasehold
