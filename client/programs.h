// `leasehold run` and the output of program jobs (`leasehold logs ID` of a
// program job): see docs/program-jobs.md.
#pragma once

#include <cstdint>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "client/jobs.h"

namespace leasehold::client {

struct RunOptions {
  std::vector<std::string> command;  // the program and its arguments
  std::string name;                  // empty: from the command
  std::string budget;                // memory_budget (empty: the default)
  std::string min;                   // memory_min (empty: the whole budget)
  std::string device;                // auto, cuda, cpu (empty: auto)
};

// Submits `options.command` as a program job with the current folder, as
// srun does: streams its output as it comes, and returns its exit status
// (the program's own; 1 when it ended otherwise, 3 when someone else
// cancelled it). Ctrl-C (SIGINT) or SIGTERM cancels it; the command then
// waits for it to end and returns 130 (143 for SIGTERM).
int run_program(const Context& ctx, const RunOptions& options);

// Writes program job `id`'s output to standard output, from the oldest
// byte kept; with `follow`, until the job ends. Returns an exit code.
int print_program_log(const Context& ctx, zmq::context_t& zctx, uint64_t id, bool follow);

}  // namespace leasehold::client
