// The plug-in's messages on standard error: one line each, as the agent
// forwards a program's standard error into the job's log line by line.
#pragma once

#include <string>

namespace leasehold::torch_plugin {

// `s` with its line breaks turned into spaces: one message, one line.
std::string one_line(std::string s);
// Writes `msg` as one line on standard error.
void print_line(const std::string& msg);
// The lease client's latest error on this thread, as one line ("no details"
// when it has none).
std::string last_error();

}  // namespace leasehold::torch_plugin
