// An agent whose GPU context was lost (a device fault: its own kernel's, or
// under MPS any client's) cannot use the GPU again in the same process: the
// CUDA runtime keeps the error. It starts itself again instead, as the same
// process (same pid, same arguments), after reporting its job.
//
// Under MPS the server refuses new clients until every client of the
// faulted context has exited, and a process whose first CUDA call was
// refused can never retry (the runtime remembers that failure too). So the
// restarted agent first waits in throwaway child processes
// (`leasehold-agent --probe-cuda-context DEVICE`) until one can create a
// context, and only then makes its own first CUDA call.
#pragma once

#include <chrono>
#include <string>

namespace leasehold {

// Replaces this process with a fresh run of `argv` (/proc/self/exe; every
// descriptor the agent holds is close-on-exec). Counts the restart in
// LEASEHOLD_AGENT_RESTARTS. Returns only when exec failed: why.
std::string restart_self(char** argv);

// How many times this agent has restarted itself (0: started fresh).
int self_restarts();

// The body of `--probe-cuda-context DEVICE`: creates a CUDA context on
// `device`. Exit status: 0 usable; kProbeNotReady the MPS server does not
// take clients yet; 1 anything else (printed to stderr).
constexpr int kProbeNotReady = 3;
int probe_cuda_context(int device);

// Runs `program --probe-cuda-context DEVICE` (with this process's
// environment, so under the same MPS folder) until it reports a usable
// context, an error other than "not ready" (then this returns and the real
// first call reports it), or `limit` passes (std::runtime_error).
void wait_for_cuda_context(const std::string& program, int device,
                           std::chrono::milliseconds limit);

}  // namespace leasehold
