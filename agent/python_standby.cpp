#include "agent/python_standby.h"

#include <spdlog/spdlog.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "shared/printable.h"

namespace leasehold {
namespace {

// After a standby ended before it was ready, no new one starts for this
// long (a broken interpreter or torch would otherwise be restarted in a
// loop); jobs run cold meanwhile.
constexpr auto kPauseAfterFailure = std::chrono::seconds(60);
constexpr size_t kMaxReadyLine = 4096;
// How long a ready standby has to read its job line.
constexpr auto kJobLineLimit = std::chrono::seconds(5);

bool starts_with(const std::string& s, const char* prefix) {
  return s.rfind(prefix, 0) == 0;
}

// Reads what is there without blocking; false at end of file or an error.
bool read_available(int fd, std::string& into) {
  char buf[16384];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      into.append(buf, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

// Writes all of `data` to the pipe `fd` (made non-blocking), waiting at
// most `limit` for a reader that does not read: a stopped or wedged standby
// must not hold the job worker.
bool write_all(int fd, const std::string& data, std::chrono::milliseconds limit) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  const auto deadline = std::chrono::steady_clock::now() + limit;
  size_t done = 0;
  while (done < data.size()) {
    const ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return false;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      errno = ETIMEDOUT;
      return false;
    }
    pollfd p{fd, POLLOUT, 0};
    ::poll(&p, 1, static_cast<int>(left.count()));
  }
  return true;
}

}  // namespace

bool startup_variable(const std::string& name) {
  // Read by the interpreter (PYTHON*, HOME for the user's site folder,
  // the locale for its encodings, TMPDIR), the loader, CUDA and the
  // libraries torch loads, and by modules a standby may preload (HF_*,
  // TRITON_*, XDG_* caches).
  static const char* const kPrefixes[] = {
      "PYTHON", "LD_",    "CUDA_", "TORCH",   "PYTORCH_",  "NCCL_",   "OMP_",   "MKL_",
      "KMP_",   "GOMP_",  "OPENBLAS_", "MALLOC_", "CUBLAS", "CUDNN", "NVIDIA_", "LC_",
      "HF_",    "TRITON_", "XDG_"};
  for (const char* p : kPrefixes) {
    if (starts_with(name, p)) return true;
  }
  return name == "HOME" || name == "LANG" || name == "LANGUAGE" || name == "TMPDIR";
}

std::optional<WarmCommand> warm_command(const std::vector<std::string>& command,
                                        const std::string& interpreter,
                                        const std::string& standby_python,
                                        const std::vector<std::string>& job_variables,
                                        std::string& why) {
  if (standby_python.empty()) {
    why = "this agent keeps no Python standbys";
    return std::nullopt;
  }
  if (command.empty() || interpreter != standby_python) {
    why = "its program is not the standbys' interpreter " + standby_python;
    return std::nullopt;
  }
  for (const auto& name : job_variables) {
    if (startup_variable(name)) {
      why = "its environment sets " + name + ", which takes effect only at start-up";
      return std::nullopt;
    }
  }
  WarmCommand warm;
  if (command.size() >= 3 && command[1] == "-m") {
    if (command[2].empty() || command[2].front() == '-') {
      why = "'-m' names no module";
      return std::nullopt;
    }
    warm.module = command[2];
    warm.argv.assign(command.begin() + 2, command.end());
    return warm;
  }
  if (command.size() < 2 || command[1].empty() || command[1].front() == '-') {
    why = "it gives the interpreter options or no script";
    return std::nullopt;
  }
  warm.argv.assign(command.begin() + 1, command.end());
  return warm;
}

PythonStandbys::PythonStandbys(PythonStandbyOptions options, ProgramRun base)
    : options_(std::move(options)), base_(std::move(base)) {
  if (options_.count <= 0) return;
  std::string path_var;
  (void)program_environment(nullptr, base_, path_var);
  try {
    python_ = find_program(options_.python, "/", path_var);
  } catch (const std::exception& e) {
    spdlog::warn("python standbys are off: {}", e.what());
    return;
  }
  spdlog::info("python standbys: {} of {} in {} mode", options_.count, python_, options_.mode);
}

int PythonStandbys::ready() const {
  int n = 0;
  for (const auto& s : standbys_) n += s.ready ? 1 : 0;
  return n;
}

bool PythonStandbys::poll(Standby& s) {
  const int pid = s.child.pid();
  for (int fd : {s.child.output_fd(), s.child.error_fd()}) {
    std::string text;
    read_available(fd, text);
    if (!text.empty()) spdlog::info("python standby pid {}: {}", pid, printable(text, 2000));
  }
  if (!s.ready) {
    read_available(s.child.report_fd(), s.reports);
    const auto nl = s.reports.find('\n');
    if (nl != std::string::npos) {
      const auto line = nlohmann::json::parse(s.reports.substr(0, nl), nullptr, false);
      const auto type = line.is_object() ? line.find("type") : line.end();
      if (line.is_object() && type != line.end() && type->is_string() &&
          type->get<std::string>() == "standby-ready") {
        s.ready = true;
        spdlog::info("python standby pid {} is ready after {:.2f} s: {}", pid,
                     std::chrono::duration<double>(Clock::now() - s.started).count(),
                     line.dump());
      } else {
        spdlog::warn("python standby pid {} said something else than ready ({}); ending it", pid,
                     printable(s.reports.substr(0, nl), 300));
        return false;
      }
      s.reports.erase(0, nl + 1);
    } else if (s.reports.size() > kMaxReadyLine) {
      spdlog::warn("python standby pid {}: no ready line in {} bytes; ending it", pid,
                   s.reports.size());
      return false;
    }
  }
  if (s.child.exited()) {
    spdlog::warn("python standby pid {} ended with status {} before it had a job", pid,
                 s.child.exit_code());
    return false;
  }
  return true;
}

void PythonStandbys::fill() {
  if (python_.empty()) return;
  for (auto it = standbys_.begin(); it != standbys_.end();) {
    if (poll(*it)) {
      ++it;
      continue;
    }
    if (!it->ready) {
      paused_until_ = Clock::now() + kPauseAfterFailure;
      spdlog::warn("python standbys: none starts for {} s after one failed to warm up; program "
                   "jobs run cold meanwhile",
                   std::chrono::duration_cast<std::chrono::seconds>(kPauseAfterFailure).count());
    }
    it = standbys_.erase(it);  // kills and reaps what is left of it
  }
  if (paused_until_ && Clock::now() < *paused_until_) return;
  paused_until_.reset();
  while (standbys_.size() < static_cast<size_t>(options_.count)) {
    ProgramLaunch launch;
    launch.exe = python_;
    launch.dir = "/";
    launch.argv = {python_, "-m", "leasehold.standby"};
    ProgramRun run = base_;
    run.environment["LEASEHOLD_STANDBY_MODE"] = options_.mode;
    if (!options_.preload.empty()) run.environment["LEASEHOLD_STANDBY_PRELOAD"] = options_.preload;
    std::string path_var;
    launch.env = program_environment(nullptr, run, path_var);
    launch.control_pipe = true;
    Standby s;
    try {
      s.child = start_program(launch);
    } catch (const std::exception& e) {
      spdlog::warn("python standbys: cannot start one: {}", e.what());
      paused_until_ = Clock::now() + kPauseAfterFailure;
      return;
    }
    s.started = Clock::now();
    spdlog::info("python standby pid {} started", s.child.pid());
    standbys_.push_back(std::move(s));
  }
}

ProgramChild PythonStandbys::take(const proto::ProgramSpec& program, const ProgramRun& run,
                                  std::string& why) {
  std::vector<std::string> command, variables;
  for (const auto* a : *program.command()) command.push_back(a->str());
  if (const auto* vars = program.environment()) {
    for (const auto* v : *vars) variables.push_back(v->name()->str());
  }
  const std::string dir = program.directory()->str();
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw std::runtime_error("program.directory: " + printable(dir) + " is not a folder here (" +
                             std::strerror(errno) + ")");
  }
  std::string path_var;
  const std::vector<std::string> env = program_environment(&program, run, path_var);
  std::string interpreter;
  if (!python_.empty() && !command.empty()) {
    try {
      interpreter = find_program(command[0], dir, path_var);
    } catch (const std::exception&) {
      // Not found: the cold start says so.
    }
  }
  auto warm = warm_command(command, interpreter, python_, variables, why);
  if (!warm) return {};
  for (auto it = standbys_.begin(); it != standbys_.end();) {
    if (!poll(*it)) {
      it = standbys_.erase(it);
      continue;
    }
    if (!it->ready) {
      ++it;
      continue;
    }
    nlohmann::json job;
    job["argv"] = warm->argv;
    job["module"] = warm->module ? nlohmann::json(*warm->module) : nlohmann::json(nullptr);
    job["cwd"] = dir;
    auto& environ = job["environ"] = nlohmann::json::object();
    for (const auto& entry : env) {
      const auto eq = entry.find('=');
      environ[entry.substr(0, eq)] = entry.substr(eq + 1);
    }
    Standby s = std::move(*it);
    it = standbys_.erase(it);
    // One line; invalid UTF-8 in a value is replaced rather than thrown on.
    const std::string line =
        job.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    if (!write_all(s.child.control_fd(), line, kJobLineLimit)) {
      spdlog::warn("python standby pid {} did not take its job ({}); trying another",
                   s.child.pid(), std::strerror(errno));
      continue;  // s is killed and reaped here
    }
    s.child.close_control();
    return std::move(s.child);
  }
  why = standbys_.empty() ? "no Python standby is running"
                          : "no Python standby is ready yet (" + std::to_string(standbys_.size()) +
                                " warming up)";
  return {};
}

}  // namespace leasehold
