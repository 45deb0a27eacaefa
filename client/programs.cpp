#include "client/programs.h"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <iostream>
#include <optional>
#include <thread>

#include "client/exit_codes.h"
#include "client/requests.h"
#include "shared/protocol.h"

namespace leasehold::client {
namespace {

using namespace std::chrono_literals;

// Set by SIGINT or SIGTERM while `leasehold run` follows its job.
std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal.store(sig); }

// How long a follower keeps asking a coordinator that does not answer (a
// restart under systemd takes seconds; jobs survive it).
constexpr auto kReconnect = 60s;

// A job name from the command: the script's name ("train.py" of
// "python3 train.py --lr 3"), else the program's, as a plain word.
std::string name_from(const std::vector<std::string>& command) {
  std::string base;
  for (const auto& arg : command) {
    if (arg.size() > 3 && arg.compare(arg.size() - 3, 3, ".py") == 0) {
      base = arg;
      break;
    }
  }
  if (base.empty()) base = command.front();
  base = std::filesystem::path(base).filename().string();
  std::string name;
  for (char c : base) {
    const bool plain = (std::isalnum(static_cast<unsigned char>(c)) &&
                        static_cast<unsigned char>(c) < 0x80) ||
                       c == '.' || c == '_' || c == '-';
    name += plain ? c : '_';
  }
  if (name.empty() || name == "." || name == "..") name = "program";
  return name.substr(0, 64);
}

struct LogState {
  uint64_t offset = 0;
  bool started = false;
  // Someone else's program's output to a terminal: its control characters
  // (escape sequences that move the cursor, retitle the window, answer
  // back) are shown, not obeyed. Newlines, tabs and carriage returns pass.
  bool defang = false;
};

std::string shown_safely(std::string_view data) {
  std::string out;
  out.reserve(data.size());
  for (char c : data) {
    const auto u = static_cast<unsigned char>(c);
    if ((u < 0x20 && c != '\n' && c != '\t' && c != '\r') || u == 0x7f) {
      out += '^';
      out += static_cast<char>(u == 0x7f ? '?' : u + 0x40);
    } else {
      out += c;
    }
  }
  return out;
}

// Writes what the coordinator has of `id`'s output past `state`; returns
// whether the job has ended and everything was written.
bool drain_log(const Context& ctx, zmq::context_t& zctx, uint64_t id, LogState& state) {
  while (true) {
    Reply r = ask(ctx, zctx, [&](flatbuffers::FlatBufferBuilder& fbb) {
      return std::pair{proto::Body::GetJobLog,
                       proto::CreateGetJobLog(fbb, id, state.offset, 0).Union()};
    });
    expect(r, proto::Body::JobLog);
    const auto* log = r->body_as_JobLog();
    if (!state.started && log->first_kept() > 0) {
      std::fprintf(stderr, "leasehold: job %llu: its first %llu bytes of output are no longer "
                   "kept\n", (unsigned long long)id, (unsigned long long)log->first_kept());
    } else if (log->offset() > state.offset) {
      std::fprintf(stderr, "\nleasehold: job %llu: %llu bytes of output were dropped meanwhile\n",
                   (unsigned long long)id,
                   (unsigned long long)(log->offset() - state.offset));
    }
    state.started = true;
    const std::string_view data = log->data() ? log->data()->string_view() : std::string_view();
    if (!data.empty()) {
      const std::string safe = state.defang ? shown_safely(data) : std::string();
      const std::string_view shown = state.defang ? std::string_view(safe) : data;
      std::fwrite(shown.data(), 1, shown.size(), stdout);
      std::fflush(stdout);
    }
    state.offset = log->offset() + data.size();
    if (state.offset < log->total()) continue;  // more than one answer holds
    return log->finished();
  }
}

// Follows `id`'s output until the job ends, asking again for kReconnect
// while the coordinator does not answer. `on_tick` runs between polls.
void follow_log(const Context& ctx, zmq::context_t& zctx, uint64_t id,
                const std::function<void()>& on_tick, LogState state = {}) {
  std::optional<std::chrono::steady_clock::time_point> unreachable_since;
  while (true) {
    try {
      if (drain_log(ctx, zctx, id, state)) return;
      unreachable_since.reset();
    } catch (const Error& e) {
      if (e.code() != ErrorCode::Timeout) throw;
      const auto now = std::chrono::steady_clock::now();
      if (!unreachable_since) {
        unreachable_since = now;
        std::fprintf(stderr, "leasehold: the coordinator does not answer; waiting up to %llds\n",
                     (long long)std::chrono::duration_cast<std::chrono::seconds>(kReconnect).count());
      } else if (now - *unreachable_since > kReconnect) {
        throw;
      }
    }
    if (on_tick) on_tick();
    std::this_thread::sleep_for(200ms);
  }
}

}  // namespace

int print_program_log(const Context& ctx, zmq::context_t& zctx, uint64_t id, bool follow) {
  LogState state;
  if (::isatty(STDOUT_FILENO)) {
    Reply r = get_job(ctx, zctx, id);
    const int64_t owner = r->body_as_JobInfo()->submitted_uid();
    state.defang = owner != static_cast<int64_t>(::getuid());
  }
  if (follow) {
    follow_log(ctx, zctx, id, {}, state);
  } else {
    drain_log(ctx, zctx, id, state);
  }
  return 0;
}

int run_program(const Context& ctx, const RunOptions& options) {
  return run_guarded([&] {
    proto::JobSpecT spec;
    spec.name = options.name.empty() ? name_from(options.command) : options.name;
    spec.program = std::make_unique<proto::ProgramSpecT>();
    spec.program->command = options.command;
    spec.program->directory = std::filesystem::canonical(std::filesystem::current_path()).string();
    spec.memory_budget = options.budget;
    spec.memory_min = options.min;
    spec.device = options.device;
    zmq::context_t zctx(1);
    const uint64_t id = submit_spec(ctx, zctx, spec);
    std::fprintf(stderr, "leasehold: job %llu '%s' submitted\n", (unsigned long long)id,
                 spec.name.c_str());
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, nullptr);
    sigaction(SIGTERM, &sa, nullptr);
    int cancelled_by = 0;
    follow_log(ctx, zctx, id, [&] {
      const int sig = g_signal.load();
      if (sig == 0 || cancelled_by != 0) return;
      cancelled_by = sig;
      std::fprintf(stderr, "\nleasehold: cancelling job %llu\n", (unsigned long long)id);
      try {
        ask(ctx, zctx, [&](flatbuffers::FlatBufferBuilder& fbb) {
          return std::pair{proto::Body::CancelJob, proto::CreateCancelJob(fbb, id).Union()};
        });
      } catch (const Error& e) {
        // Not cancelled yet: the next tick asks again (the job must not
        // run on because the coordinator was slow to answer once).
        std::fprintf(stderr, "leasehold: could not cancel job %llu yet (%s); trying again\n",
                     (unsigned long long)id, e.what());
        cancelled_by = 0;
      }
    });
    Reply r = get_job(ctx, zctx, id);
    const auto* j = r->body_as_JobInfo();
    const std::string state(job_state_text(*j));
    const std::string reason(str(j->reason()));
    if (state == "succeeded") return 0;
    std::fprintf(stderr, "leasehold: job %llu '%s' %s%s%s\n", (unsigned long long)id,
                 spec.name.c_str(), state.c_str(), reason.empty() ? "" : ": ", reason.c_str());
    if (cancelled_by != 0) return 128 + cancelled_by;
    if (state == "cancelled") return int{kExitCancelled};
    return j->exit_code() > 0 && j->exit_code() < 256 ? j->exit_code() : 1;
  });
}

}  // namespace leasehold::client
