#include "tests/support/faults.h"

#include <sys/wait.h>
#include <unistd.h>

namespace leasehold::testing {

bool faults(const std::function<void()>& touch) {
  const pid_t child = ::fork();
  if (child == 0) {
    touch();
    ::_exit(0);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
}

}  // namespace leasehold::testing
