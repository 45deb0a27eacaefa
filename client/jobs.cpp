#include "client/jobs.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <thread>

#include "client/job_format.h"
#include "client/json_text.h"
#include "client/programs.h"
#include "client/requests.h"
#include "shared/connection.h"
#include "shared/job_spec.h"
#include "shared/protocol.h"
#include "shared/safetensors.h"
#include "shared/units.h"

namespace leasehold::client {
namespace {

// How long a follower keeps waiting for a coordinator that went away (a
// restart under systemd takes seconds; jobs survive it).
constexpr std::chrono::seconds kFollowReconnect{60};

// Follows a job on the events socket until it ends; prints progress (a live
// bar on a terminal, plain lines otherwise) and each finished epoch. Keeps
// following across a coordinator restart.
int follow_job(const Context& ctx, zmq::context_t& zctx, uint64_t id) {
  if (ctx.events_endpoint.empty()) {
    throw std::runtime_error("no events endpoint for " + ctx.endpoint +
                             " (set --events-endpoint)");
  }
  zmq::socket_t sub(zctx, zmq::socket_type::sub);
  sub.set(zmq::sockopt::linger, 0);
  if (needs_curve(ctx.events_endpoint)) {
    if (!ctx.curve) throw std::runtime_error("the events endpoint " + ctx.events_endpoint + " needs CURVE keys (--curve-key, --curve-server-key)");
    apply_curve_client(sub, *ctx.curve);
  }
  std::string topic = "job." + std::to_string(id) + ".";
  sub.set(zmq::sockopt::subscribe, topic);
  sub.connect(ctx.events_endpoint);
  const bool tty = isatty(STDOUT_FILENO);
  int last_epoch = 0;  // by number: epochs run again after a resume are not repeated
  bool bar_shown = false;
  std::string last_line;
  auto show = [&](const proto::JobInfo& j) -> int {
    if (j.epochs()) {
      for (const auto* e : *j.epochs()) {
        if (e->epoch() <= last_epoch) continue;
        last_epoch = e->epoch();
        if (bar_shown) std::printf("\r\033[K");
        bar_shown = false;
        std::printf("job %llu epoch %d: %s, %.1f s\n", (unsigned long long)id, e->epoch(),
                    epoch_figures(*e).c_str(), e->seconds());
      }
    }
    std::string state(job_state_text(j));
    int code = outcome(state);
    if (code >= 0) {
      if (bar_shown) std::printf("\r\033[K");
      if (code == 0) {
        std::printf("job %llu '%s' succeeded: %s\n", (unsigned long long)id,
                    std::string(str(j.name())).c_str(), result_summary(j).c_str());
      } else {
        std::printf("job %llu '%s' %s: %s\n", (unsigned long long)id,
                    std::string(str(j.name())).c_str(), state.c_str(),
                    std::string(str(j.reason())).c_str());
      }
      std::fflush(stdout);
      return code;
    }
    std::string reason(j.waiting_for() && j.waiting_for()->size() ? str(j.waiting_for())
                                                                  : str(j.reason()));
    std::string line = state == "queued" ? (reason.empty() ? "queued" : "queued: " + reason)
                                         : progress_line(j, tty);
    if (line != last_line) {
      if (tty) {
        std::printf("\r\033[Kjob %llu %s", (unsigned long long)id, line.c_str());
        bar_shown = true;
      } else {
        std::printf("job %llu %s\n", (unsigned long long)id, line.c_str());
      }
      std::fflush(stdout);
      last_line = line;
    }
    return -1;
  };
  // Subscribe first, then read the current state, so nothing is missed.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  auto last_check = std::chrono::steady_clock::now();
  std::optional<std::chrono::steady_clock::time_point> unreachable_since;
  {
    Reply r = get_job(ctx, zctx, id);
    if (int c = show(*r->body_as_JobInfo()); c >= 0) return c;
  }
  while (true) {
    zmq::pollitem_t item{sub.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(1000));
    if (item.revents & ZMQ_POLLIN) {
      zmq::message_t t, body;
      if (sub.recv(t) && t.more() && sub.recv(body)) {
        AlignedBytes bytes(body);
        auto d = decode(bytes.bytes());
        if (auto* env = std::get_if<const proto::Envelope*>(&d);
            env && (*env)->body_type() == proto::Body::JobInfo) {
          if (int c = show(*(*env)->body_as_JobInfo()); c >= 0) return c;
        }
      }
    }
    // Every few seconds ask directly too: covers a lost event, and notices a
    // coordinator that went away; after kFollowReconnect without one the
    // request's error ends the command (exit code 4).
    if (std::chrono::steady_clock::now() - last_check > std::chrono::seconds(5)) {
      last_check = std::chrono::steady_clock::now();
      try {
        Reply r = get_job(ctx, zctx, id);
        if (unreachable_since) {
          std::printf("job %llu: the coordinator is back\n", (unsigned long long)id);
          unreachable_since.reset();
        }
        if (int c = show(*r->body_as_JobInfo()); c >= 0) return c;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::Timeout) throw;
        auto now = std::chrono::steady_clock::now();
        if (!unreachable_since) {
          unreachable_since = now;
          if (bar_shown) std::printf("\r\033[K");
          bar_shown = false;
          last_line.clear();
          std::printf("job %llu: the coordinator does not answer; waiting up to %llds for it\n",
                      (unsigned long long)id, (long long)kFollowReconnect.count());
          std::fflush(stdout);
        } else if (now - *unreachable_since > kFollowReconnect) {
          throw;
        }
      }
    }
  }
}

}  // namespace

std::unique_ptr<proto::JobSpecT> load_job_file(const std::string& file,
                                               const SubmitOverrides& overrides) {
  std::ifstream in(file);
  if (!in) {
    throw JobSpecError({"cannot read job file " + file + ": " + std::strerror(errno)});
  }
  std::stringstream text;
  text << in.rdbuf();
  auto buffer = parse_job_json(text.str(), file);
  std::unique_ptr<proto::JobSpecT> spec(verify_job(buffer)->UnPack());
  if (overrides.priority) spec->priority = *overrides.priority;
  if (overrides.epochs) {
    spec->epochs = *overrides.epochs;
    spec->steps = 0;
  }
  // A checkpoint folder as this user sees it: made absolute and resolved
  // (the coordinator and agents take only a path without links).
  if (spec->checkpoint && !spec->checkpoint->directory.empty()) {
    std::error_code ec;
    auto dir = std::filesystem::absolute(spec->checkpoint->directory, ec);
    if (!ec) {
      auto real = std::filesystem::canonical(dir, ec);
      spec->checkpoint->directory = (ec ? dir.lexically_normal() : real).string();
    }
  }
  // Everything but the files, which the coordinator checks where the job
  // runs: a mistake is caught before the coordinator is asked.
  validate_job(*spec, ValidationOptions{false, 0, JobLengthLimits::none()});
  return spec;
}

int submit(const Context& ctx, const proto::JobSpecT& spec, bool follow) {
  return run_guarded([&] {
    zmq::context_t zctx(1);
    const uint64_t id = submit_spec(ctx, zctx, spec);

    if (ctx.json) {
      std::cout << nlohmann::json{{"id", id}}.dump() << "\n";
    } else {
      std::cout << id << "\n";
    }
    std::cout.flush();
    return follow ? follow_job(ctx, zctx, id) : 0;
  });
}

int list_jobs(const Context& ctx) {
  return run_guarded([&] {
    zmq::context_t zctx(1);
    // Page by page (each reply stays far below the message size limit).
    std::vector<Reply> pages;
    std::vector<const proto::JobInfo*> jobs;
    uint64_t after = 0;
    bool more = true;
    while (more) {
      pages.push_back(ask(ctx, zctx, [after](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::ListJobs, proto::CreateListJobs(fbb, after).Union()};
      }));
      expect(pages.back(), proto::Body::JobList);
      const auto* list = pages.back()->body_as_JobList();
      if (list->jobs()) {
        for (const auto* j : *list->jobs()) {
          jobs.push_back(j);
          after = j->id();
        }
      }
      more = list->more() && list->jobs() && list->jobs()->size() > 0;
    }
    if (ctx.json) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto* j : jobs) out.push_back(job_to_json(*j));
      std::cout << json_text(out) << "\n";
    } else {
      std::cout << jobs_to_table(jobs);
    }
    return 0;
  });
}

int show_job(const Context& ctx, uint64_t id) {
  return run_guarded([&] {
    zmq::context_t zctx(1);
    Reply r = get_job(ctx, zctx, id);
    const auto* j = r->body_as_JobInfo();
    std::cout << (ctx.json ? json_text(job_to_json(*j)) + "\n" : job_to_text(*j));
    return 0;
  });
}

int cancel_job(const Context& ctx, uint64_t id) {
  return run_guarded([&] {
    zmq::context_t zctx(1);
    ask(ctx, zctx, [id](flatbuffers::FlatBufferBuilder& fbb) {
      return std::pair{proto::Body::CancelJob, proto::CreateCancelJob(fbb, id).Union()};
    });
    std::cout << "cancel requested for job " << id << "\n";
    return 0;
  });
}

int logs(const Context& ctx, uint64_t id, bool follow) {
  return run_guarded([&] {
    zmq::context_t zctx(1);
    Reply r = get_job(ctx, zctx, id);
    const auto* j = r->body_as_JobInfo();
    // A program job's log is its output.
    if (j->spec() && j->spec()->program() && !ctx.json) {
      return print_program_log(ctx, zctx, id, follow);
    }
    if (follow) return follow_job(ctx, zctx, id);
    if (ctx.json) {
      std::cout << json_text(job_to_json(*j)["epochs"]) << "\n";
      return 0;
    }
    if (j->epochs()) {
      for (const auto* e : *j->epochs()) {
        std::printf("job %llu epoch %d: %s, %.1f s\n", (unsigned long long)id, e->epoch(),
                    epoch_figures(*e).c_str(), e->seconds());
      }
    }
    std::printf("job %llu %s\n", (unsigned long long)id, progress_line(*j, false).c_str());
    return 0;
  });
}

int fetch_checkpoint(const Context& ctx, uint64_t id, const std::string& output,
                     const std::string& format) {
  return run_guarded([&] {
    const bool safetensors =
        format == "safetensors" ||
        (format == "auto" && std::filesystem::path(output).extension() == ".safetensors");
    zmq::context_t zctx(1);
    std::string bytes;
    uint64_t total = 0, version = 0;
    int32_t epoch = 0;
    std::string name;
    do {
      Reply r = ask(ctx, zctx, [&](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::GetCheckpoint,
                         proto::CreateGetCheckpoint(fbb, id, bytes.size()).Union()};
      });
      expect(r, proto::Body::CheckpointData);
      const auto* d = r->body_as_CheckpointData();
      // A checkpoint replaced meanwhile (the next epoch's): start over.
      if (!bytes.empty() && (d->version() != version || d->total() != total)) {
        bytes.clear();
        continue;
      }
      total = d->total();
      version = d->version();
      epoch = d->epoch();
      name = std::string(str(d->name()));
      if (!d->data() || d->data()->size() == 0) {
        if (bytes.size() < total) throw std::runtime_error("the coordinator sent an empty piece");
        break;
      }
      bytes.append(reinterpret_cast<const char*>(d->data()->data()), d->data()->size());
    } while (bytes.size() < total);
    // Checked whole (its checksum) before anything is written.
    auto tensors = read_checkpoint_tensors(bytes, "the checkpoint of job " + std::to_string(id));
    std::string out = bytes;
    if (safetensors) {
      out = to_safetensors(tensors, {{"format", "pt"},
                                     {"leasehold_job", std::to_string(id)},
                                     {"leasehold_epoch", std::to_string(epoch)}});
    }
    // Whole or not at all: a temporary file beside it, renamed over it.
    const std::string tmp = output + ".part";
    {
      // A new file of ours, never one a link points at.
      ::unlink(tmp.c_str());
      const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
      if (fd < 0) {
        throw JobSpecError({"cannot write " + tmp + ": " + std::strerror(errno)});
      }
      size_t done = 0;
      while (done < out.size()) {
        const ssize_t n = ::write(fd, out.data() + done, out.size() - done);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) {
          const int e = errno;
          ::close(fd);
          ::unlink(tmp.c_str());
          throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(e));
        }
        done += static_cast<size_t>(n);
      }
      const bool synced = ::fsync(fd) == 0;
      const int sync_error = errno;
      const bool closed = ::close(fd) == 0;
      if (!synced || !closed) {
        const int e = synced ? errno : sync_error;
        ::unlink(tmp.c_str());
        throw std::runtime_error("cannot write " + tmp + ": " + std::strerror(e));
      }
    }
    if (::rename(tmp.c_str(), output.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      throw std::runtime_error("cannot rename " + tmp + " to " + output + ": " + std::strerror(e));
    }
    std::cerr << "job " << id << ": " << name << " (epoch " << epoch << ", "
              << format_bytes(bytes.size()) << ") written to " << output
              << (safetensors ? " as safetensors" : "") << "\n";
    return 0;
  });
}

}  // namespace leasehold::client
