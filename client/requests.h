// What the client's commands share: a request to the coordinator, a job's
// record, a submission (with its key and retries), and the exit codes
// (client/jobs.h).
#pragma once

#include <functional>
#include <string>
#include <zmq.hpp>

#include "client/jobs.h"
#include "schemas/leasehold_generated.h"
#include "shared/connection.h"

namespace leasehold::client {

// One request on a connection of its own; throws Error with the
// coordinator's refusal.
Reply ask(const Context& ctx, zmq::context_t& zctx, const Connection::BodyBuilder& build);
// Throws when the coordinator answers with another body than `expected`.
void expect(const Reply& r, proto::Body expected);
// The job's record (JobInfo).
Reply get_job(const Context& ctx, zmq::context_t& zctx, uint64_t id);
// The exit code of a job's final state; -1 while it has not ended.
int outcome(const std::string& state);
// The exit code (client/exit_codes.h) of the coordinator's refusal `e`.
int exit_code_of(const Error& e);
// Runs a command, turning its exceptions into a message and an exit code.
int run_guarded(const std::function<int()>& f);
// Validates `spec` (all but its files, which the coordinator checks) and
// submits it under a key of its own, asking again with the same key when a
// reply is lost or the store fails, for up to four request timeouts: one
// call never queues two jobs. Returns the job's id; throws the refusal.
uint64_t submit_spec(const Context& ctx, zmq::context_t& zctx, const proto::JobSpecT& spec);

}  // namespace leasehold::client
