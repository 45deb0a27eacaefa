// What the kernel says of a process on this host, from /proc/PID/stat.
#pragma once

#include <optional>

namespace leasehold {

// The process's state letter (R, S, D, Z = dead but not yet reaped, ...);
// nullopt when there is no such process (or no /proc).
std::optional<char> process_state(int pid);

// Whether `pid` is certainly gone: no such process, or a zombie.
bool process_gone(int pid);

}  // namespace leasehold
