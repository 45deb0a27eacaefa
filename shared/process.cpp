#include "shared/process.h"

#include <signal.h>

#include <cerrno>
#include <fstream>
#include <string>

namespace leasehold {

std::optional<char> process_state(int pid) {
  if (pid <= 0) return std::nullopt;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return std::nullopt;
  // "PID (COMM) STATE ...": COMM may hold spaces and parentheses.
  auto close = line.rfind(')');
  if (close == std::string::npos || close + 2 >= line.size()) return std::nullopt;
  return line[close + 2];
}

bool process_gone(int pid) {
  if (pid <= 0) return false;
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  auto state = process_state(pid);
  return state && (*state == 'Z' || *state == 'X');
}

}  // namespace leasehold
