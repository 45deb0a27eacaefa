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

#include <atomic>
#include <chrono>
#include <string>

namespace leasehold {

// Replaces this process with a fresh run of `argv` (/proc/self/exe). Every
// descriptor above stderr is marked close-on-exec first (the CUDA driver's
// and the MPS client's too, so the server sees this client go). Counts the
// restart in LEASEHOLD_AGENT_RESTARTS and passes the GPU (`device`, -1:
// unknown) in LEASEHOLD_AGENT_GPU. Returns only when exec failed: why.
std::string restart_self(char** argv, int device);

// How many times this agent has restarted itself in a row (0: started
// fresh), and the GPU the previous run used (0 when unknown).
int self_restarts();
int restart_device();
// Called once the agent stands by again: the next restart counts from 1.
void reset_self_restarts();
// Restarts after this many in a row the agent gives up (a GPU that fails
// every time is not coming back by itself).
constexpr int kMaxSelfRestarts = 20;

// The body of `--probe-cuda-context DEVICE`: creates a CUDA context on
// `device`. Exit status: 0 usable; kProbeNotReady the MPS server does not
// take clients yet; 1 anything else (printed to stderr).
constexpr int kProbeNotReady = 3;
int probe_cuda_context(int device);

// Runs `program --probe-cuda-context DEVICE` (with this process's
// environment, so under the same MPS folder) until it reports a usable
// context, an error other than "not ready" (then this returns and the real
// first call reports it), `stop` is set, or `limit` passes
// (std::runtime_error). Call before registering: it can take a while.
void wait_for_cuda_context(const std::string& program, int device,
                           std::chrono::milliseconds limit, const std::atomic<bool>& stop);

}  // namespace leasehold
