// Whether touching memory faults, checked in a forked child so the test
// survives it.
#pragma once

#include <functional>

namespace leasehold::testing {

// Runs `touch` in a forked child of this process. True when the child was
// killed by a signal or (under AddressSanitizer, whose handler reports the
// fault) exited with a failure: the touch alone cannot fail otherwise.
bool faults(const std::function<void()>& touch);

}  // namespace leasehold::testing
