#include "client/requests.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <thread>

#include "client/exit_codes.h"
#include "shared/job_spec.h"
#include "shared/session_token.h"

namespace leasehold::client {

Reply ask(const Context& ctx, zmq::context_t& zctx, const Connection::BodyBuilder& build) {
  Connection conn(zctx, ctx.endpoint, "leasehold-cli-" + std::to_string(getpid()), ctx.curve);
  Reply r = conn.request(build, ctx.timeout);
  r.throw_if_error();
  return r;
}

void expect(const Reply& r, proto::Body expected) {
  if (r->body_type() != expected) {
    throw std::runtime_error(std::string("coordinator answered with ") +
                             proto::EnumNameBody(r->body_type()) + " where " +
                             proto::EnumNameBody(expected) + " was expected");
  }
}

Reply get_job(const Context& ctx, zmq::context_t& zctx, uint64_t id) {
  Reply r = ask(ctx, zctx, [id](flatbuffers::FlatBufferBuilder& fbb) {
    return std::pair{proto::Body::GetJob, proto::CreateGetJob(fbb, id).Union()};
  });
  expect(r, proto::Body::JobInfo);
  return r;
}

int outcome(const std::string& state) {
  if (state == "succeeded") return kExitOk;
  if (state == "failed") return kExitJobFailed;
  if (state == "cancelled") return kExitCancelled;
  return -1;  // not finished
}

int exit_code_of(const Error& e) {
  switch (e.code()) {
    case ErrorCode::InvalidArgument:
    case ErrorCode::TooLarge:
      return kExitInvalid;
    case ErrorCode::PermissionDenied:
    case ErrorCode::NotOwner:
      return kExitDenied;
    default:
      return kExitUnreachable;
  }
}

int run_guarded(const std::function<int()>& f) {
  try {
    return f();
  } catch (const JobSpecError& e) {
    std::cerr << "leasehold: " << e.what() << "\n";
    return kExitInvalid;
  } catch (const Error& e) {
    std::cerr << "leasehold: " << e.what() << "\n";
    return exit_code_of(e);
  } catch (const std::exception& e) {
    std::cerr << "leasehold: " << e.what() << "\n";
    return kExitUnreachable;
  }
}

uint64_t submit_spec(const Context& ctx, zmq::context_t& zctx, const proto::JobSpecT& spec) {
  // Files are checked by the coordinator, on the host where the job runs.
  validate_job(spec, ValidationOptions{false, 0, JobLengthLimits::none()});
  // One key for this submission and every retry of it: the coordinator
  // answers a retry with the job it already queued, never a second one.
  const SessionToken token = SessionToken::random();
  char key[33];
  std::snprintf(key, sizeof key, "%016llx%016llx", static_cast<unsigned long long>(token.hi),
                static_cast<unsigned long long>(token.lo));
  // Retried while unanswered (a lost reply, a busy coordinator) or while
  // its job store cannot commit, for up to four request timeouts.
  const auto deadline = std::chrono::steady_clock::now() + 4 * ctx.timeout;
  Reply r;
  while (true) {
    try {
      r = ask(ctx, zctx, [&](flatbuffers::FlatBufferBuilder& fbb) {
        auto s = proto::JobSpec::Pack(fbb, &spec);
        return std::pair{proto::Body::SubmitJob,
                         proto::CreateSubmitJob(fbb, s, fbb.CreateString(key)).Union()};
      });
      break;
    } catch (const Error& e) {
      const bool again = e.code() == ErrorCode::Timeout || e.code() == ErrorCode::Unavailable;
      if (!again || std::chrono::steady_clock::now() >= deadline) throw;
      std::cerr << "leasehold: " << e.what() << "; asking again (the same submission)\n";
      if (e.code() == ErrorCode::Unavailable) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  }
  expect(r, proto::Body::JobAccepted);
  return r->body_as_JobAccepted()->job_id();
}

}  // namespace leasehold::client
