// Orderly shutdown for the daemons: SIGTERM and SIGINT set a flag that the
// main loop polls; SIGPIPE is ignored (socket errors are handled in place).
#pragma once

#include <atomic>

namespace leasehold {

// Installs the handlers and returns the flag they set. Call once, early.
const std::atomic<bool>& install_stop_signals();

}  // namespace leasehold
