#include "torch_plugin/messages.h"

#include <cstdio>

#include "leasehold.h"

namespace leasehold::torch_plugin {

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

void print_line(const std::string& msg) {
  std::string line = one_line(msg) + "\n";
  (void)!std::fwrite(line.data(), 1, line.size(), stderr);
}

std::string last_error() {
  const char* m = lh_last_error();
  return m && *m ? one_line(m) : std::string("no details");
}

}  // namespace leasehold::torch_plugin
