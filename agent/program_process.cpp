#include "agent/program_process.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spdlog/spdlog.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <tuple>
#include <utility>

#include "shared/printable.h"
#include "shared/program_spec.h"

extern char** environ;

namespace leasehold {
namespace {

using Clock = std::chrono::steady_clock;

// A report line longer than this is not one (leasehold.report writes far
// less); it is dropped.
constexpr size_t kMaxReportLine = 4096;
// Standard error kept for the failure's reason.
constexpr size_t kStderrTail = 4096;
// Output read at once (one log chunk at most).
constexpr size_t kReadBytes = 64 << 10;
// After the program ended and its group was killed, how long its pipes are
// read for what is left in them.
constexpr auto kDrainAfterExit = std::chrono::seconds(2);

std::string errno_text(int err) { return std::strerror(err); }

// A file descriptor closed on destruction.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(std::exchange(o.fd, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd = std::exchange(o.fd, -1);
    }
    return *this;
  }
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

std::pair<Fd, Fd> make_pipe() {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) {
    throw std::runtime_error("cannot make a pipe for the program: " + errno_text(errno));
  }
  return {Fd(fds[0]), Fd(fds[1])};
}

int open_pidfd(pid_t pid) { return static_cast<int>(::syscall(SYS_pidfd_open, pid, 0)); }

// Reads what is there (never blocks: the pipes are non-blocking); false at
// end of file or on an error.
bool read_some(int fd, std::string& into) {
  char buf[kReadBytes];
  while (true) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n > 0) {
      into.append(buf, static_cast<size_t>(n));
      if (into.size() >= kReadBytes) return true;
      continue;
    }
    if (n == 0) return false;
    if (errno == EINTR) continue;
    return errno == EAGAIN || errno == EWOULDBLOCK;
  }
}

void set_nonblocking(int fd) { ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK); }

std::optional<int64_t> count_field(const nlohmann::json& j, const char* name, std::string& why) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer() || it->get<int64_t>() < 0) {
    why = std::string("'") + name + "' is not a whole number >= 0";
    return std::nullopt;
  }
  return it->get<int64_t>();
}

std::optional<double> real_field(const nlohmann::json& j, const char* name, std::string& why) {
  auto it = j.find(name);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (!it->is_number() || !std::isfinite(it->get<double>())) {
    why = std::string("'") + name + "' is not a finite number";
    return std::nullopt;
  }
  return it->get<double>();
}

}  // namespace

namespace {

bool executable_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(path.c_str(), X_OK) == 0;
}

}  // namespace

// Found before the fork: the child may call only what is async-signal-safe.
std::string find_program(const std::string& name, const std::string& dir,
                            const std::string& path_var) {
  if (name.find('/') != std::string::npos) {
    const std::string path = name.front() == '/' ? name : dir + "/" + name;
    if (!executable_file(path)) {
      throw std::runtime_error("program.command[0]: " + printable(path) +
                               " is not an executable file");
    }
    return path;
  }
  size_t start = 0;
  while (start <= path_var.size()) {
    size_t end = path_var.find(':', start);
    if (end == std::string::npos) end = path_var.size();
    std::string entry = path_var.substr(start, end - start);
    if (entry.empty()) entry = ".";
    if (entry.front() != '/') entry = dir + "/" + entry;
    const std::string candidate = entry + "/" + name;
    if (executable_file(candidate)) return candidate;
    start = end + 1;
  }
  throw std::runtime_error("program.command[0]: '" + printable(name) +
                           "' was not found on the PATH (" + printable(path_var, 512) +
                           "); give its full path");
}

std::vector<std::string> program_environment(const proto::ProgramSpec* program,
                                             const ProgramRun& run, std::string& path_var) {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string_view entry(*e);
    const auto eq = entry.find('=');
    if (eq == std::string_view::npos) continue;
    std::string name(entry.substr(0, eq));
    if (reserved_environment_name(name)) continue;
    env[name] = std::string(entry.substr(eq + 1));
  }
  if (const auto* vars = program ? program->environment() : nullptr) {
    for (const auto* v : *vars) env[v->name()->str()] = v->value() ? v->value()->str() : "";
  }
  for (const auto& [name, value] : run.environment) env[name] = value;
  std::string python_path;
  for (const auto& dir : run.python_path) python_path += (python_path.empty() ? "" : ":") + dir;
  if (auto it = env.find("PYTHONPATH"); it != env.end() && !it->second.empty()) {
    python_path += (python_path.empty() ? "" : ":") + it->second;
  }
  if (!python_path.empty()) env["PYTHONPATH"] = python_path;
  path_var = env.count("PATH") ? env["PATH"] : "/usr/local/bin:/usr/bin:/bin";
  std::vector<std::string> out;
  out.reserve(env.size());
  for (const auto& [name, value] : env) out.push_back(name + "=" + value);
  return out;
}

std::optional<ProgramReport> parse_report_line(std::string_view line, std::string& why,
                                               std::optional<proto::ProgramMemoryT>& memory) {
  why.clear();
  nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    why = "not a JSON object";
    return std::nullopt;
  }
  const auto type_at = j.find("type");
  if (type_at == j.end() || !type_at->is_string()) {
    why = "its type is not a string";
    return std::nullopt;
  }
  const std::string type = type_at->get<std::string>();
  if (type == "memory") {
    proto::ProgramMemoryT m;
    const std::pair<const char*, uint64_t*> fields[] = {
        {"leased_bytes", &m.leased_bytes},   {"peak_leased_bytes", &m.peak_leased_bytes},
        {"in_use_bytes", &m.in_use_bytes},   {"peak_in_use_bytes", &m.peak_in_use_bytes},
        {"allocations", &m.allocations},     {"cache_hits", &m.cache_hits},
        {"lease_requests", &m.lease_requests}, {"spilled_bytes", &m.spilled_bytes},
        {"restored_bytes", &m.restored_bytes}};
    for (const auto& [name, into] : fields) {
      auto v = count_field(j, name, why);
      if (!why.empty()) return std::nullopt;
      if (v) *into = static_cast<uint64_t>(*v);
    }
    memory = m;
    return ProgramReport{};
  }
  if (type != "report") {
    why = "its type is not report or memory";
    return std::nullopt;
  }
  ProgramReport r;
  r.step = count_field(j, "step", why);
  if (why.empty()) r.epoch = count_field(j, "epoch", why);
  if (why.empty()) r.samples = count_field(j, "samples", why);
  if (why.empty()) r.loss = real_field(j, "loss", why);
  if (why.empty()) r.test_accuracy = real_field(j, "test_accuracy", why);
  if (!why.empty()) return std::nullopt;
  return r;
}

// ---- ProgramChild ------------------------------------------------------------------

ProgramChild& ProgramChild::operator=(ProgramChild&& o) noexcept {
  if (this != &o) {
    kill_and_reap();
    pid_ = std::exchange(o.pid_, -1);
    pidfd_ = std::exchange(o.pidfd_, -1);
    out_ = std::exchange(o.out_, -1);
    err_ = std::exchange(o.err_, -1);
    rep_ = std::exchange(o.rep_, -1);
    ctl_ = std::exchange(o.ctl_, -1);
    reaped_ = std::exchange(o.reaped_, false);
    status_ = std::exchange(o.status_, 0);
  }
  return *this;
}

void ProgramChild::close_fds() {
  for (int* fd : {&pidfd_, &out_, &err_, &rep_, &ctl_}) {
    if (*fd >= 0) ::close(*fd);
    *fd = -1;
  }
}

void ProgramChild::kill_and_reap() {
  if (pid_ > 0 && !reaped_) {
    ::kill(-pid_, SIGKILL);
    while (::waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
    }
    reaped_ = true;
  }
  close_fds();
  pid_ = -1;
}

void ProgramChild::close_control() {
  if (ctl_ >= 0) ::close(ctl_);
  ctl_ = -1;
}

bool ProgramChild::exited() {
  if (pid_ <= 0 || reaped_) return true;
  // Exited, but not reaped yet (WNOWAIT): its pid, the group's id, is not
  // free for reuse while whatever it left running in its group is killed.
  siginfo_t info{};
  if (::waitid(P_PID, static_cast<id_t>(pid_), &info, WEXITED | WNOHANG | WNOWAIT) != 0 ||
      info.si_pid != pid_) {
    return false;
  }
  ::kill(-pid_, SIGKILL);
  while (::waitpid(pid_, &status_, 0) < 0 && errno == EINTR) {
  }
  reaped_ = true;
  return true;
}

int ProgramChild::exit_code() const {
  if (WIFEXITED(status_)) return WEXITSTATUS(status_);
  if (WIFSIGNALED(status_)) return 128 + WTERMSIG(status_);
  return 0;
}

ProgramChild start_program(const ProgramLaunch& launch) {
  // Everything the child needs, made before the fork.
  std::vector<std::string> args = launch.argv, env = launch.env;
  std::vector<char*> argv, envp;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  for (auto& e : env) envp.push_back(e.data());
  envp.push_back(nullptr);
  const std::string exe = launch.exe, dir = launch.dir;
  Fd null_in(::open("/dev/null", O_RDONLY | O_CLOEXEC));
  if (null_in.fd < 0) throw std::runtime_error("cannot open /dev/null: " + errno_text(errno));
  auto [out_r, out_w] = make_pipe();
  auto [err_r, err_w] = make_pipe();
  auto [rep_r, rep_w] = make_pipe();
  Fd ctl_r, ctl_w;
  if (launch.control_pipe) std::tie(ctl_r, ctl_w) = make_pipe();
  const int targets = launch.control_pipe ? 5 : 4;
  const pid_t parent = ::getpid();
  const long open_max = ::sysconf(_SC_OPEN_MAX);  // for the child, where sysconf is not safe
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("cannot start the program: fork: " + errno_text(errno));
  if (pid == 0) {
    // The child: async-signal-safe calls only, then exec.
    ::setpgid(0, 0);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the agent died before the prctl
    // Out of the way of the targets first (fds 0-4 may be any of them).
    int fds[5] = {::fcntl(null_in.fd, F_DUPFD, 10), ::fcntl(out_w.fd, F_DUPFD, 10),
                  ::fcntl(err_w.fd, F_DUPFD, 10), ::fcntl(rep_w.fd, F_DUPFD, 10),
                  targets == 5 ? ::fcntl(ctl_r.fd, F_DUPFD, 10) : -1};
    for (int i = 0; i < targets; ++i) {
      if (fds[i] < 0 || ::dup2(fds[i], i) < 0) ::_exit(127);
    }
    const unsigned first = static_cast<unsigned>(targets);
    if (::syscall(SYS_close_range, first, ~0u, 0u) != 0) {  // before Linux 5.9: one by one
      for (long fd = first; fd < (open_max > 0 ? open_max : 65536); ++fd) {
        ::close(static_cast<int>(fd));
      }
    }
    // The agent's handlers are the agent's: a SIGTERM (a cancel) arriving
    // before execve must end the child, not set a flag in its copy.
    struct sigaction dfl {};
    dfl.sa_handler = SIG_DFL;
    for (int sig = 1; sig < NSIG; ++sig) {
      if (sig != SIGKILL && sig != SIGSTOP) ::sigaction(sig, &dfl, nullptr);
    }
    sigset_t none;
    sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    if (::chdir(dir.c_str()) != 0) {
      static const char msg[] = "leasehold-agent: cannot enter the program's directory\n";
      (void)!::write(2, msg, sizeof msg - 1);
      ::_exit(127);
    }
    ::execve(exe.c_str(), argv.data(), envp.data());
    static const char msg[] = "leasehold-agent: cannot run the program (execve failed)\n";
    (void)!::write(2, msg, sizeof msg - 1);
    ::_exit(127);
  }
  // The parent.
  ::setpgid(pid, pid);  // also here: no race with a kill of the group
  ProgramChild child;
  child.pid_ = pid;
  child.pidfd_ = open_pidfd(pid);
  child.out_ = std::exchange(out_r.fd, -1);
  child.err_ = std::exchange(err_r.fd, -1);
  child.rep_ = std::exchange(rep_r.fd, -1);
  child.ctl_ = std::exchange(ctl_w.fd, -1);
  for (int fd : {child.out_, child.err_, child.rep_}) set_nonblocking(fd);
  return child;
}

// ---- supervising ---------------------------------------------------------------------

ProgramOutcome supervise(ProgramChild& child, const ProgramRun& run) {
  const pid_t pid = child.pid();
  if (run.on_start) run.on_start(pid);

  ProgramOutcome outcome;
  std::string report_buf;
  bool report_too_long = false, warned = false;
  auto take_output = [&](std::string& chunk, bool is_stderr) {
    if (chunk.empty()) return;
    if (is_stderr) {
      outcome.stderr_tail += chunk;
      if (outcome.stderr_tail.size() > kStderrTail) {
        outcome.stderr_tail.erase(0, outcome.stderr_tail.size() - kStderrTail);
      }
    }
    if (run.on_output) run.on_output(chunk, outcome.output_bytes);
    outcome.output_bytes += chunk.size();
    chunk.clear();
  };
  auto take_reports = [&](std::string& bytes) {
    report_buf += bytes;
    bytes.clear();
    size_t nl;
    while ((nl = report_buf.find('\n')) != std::string::npos) {
      const std::string line = report_buf.substr(0, nl);
      report_buf.erase(0, nl + 1);
      if (report_too_long) {  // the end of a line that was too long
        report_too_long = false;
        continue;
      }
      std::string why;
      std::optional<proto::ProgramMemoryT> memory;
      auto r = parse_report_line(line, why, memory);
      if (!r) {
        if (!warned) {
          spdlog::warn("program pid {}: a report line was not used ({}); later ones are dropped "
                       "without a word",
                       pid, why);
          warned = true;
        }
        continue;
      }
      if (memory) {
        if (run.on_memory) run.on_memory(*memory);
      } else if (run.on_report) {
        run.on_report(*r);
      }
    }
    if (report_buf.size() > kMaxReportLine) {
      report_buf.clear();
      report_too_long = true;
    }
  };

  std::optional<Clock::time_point> term_sent, exited_at;
  bool out_open = true, err_open = true, rep_open = true, killed = false;
  bool ended = false;
  while (true) {
    pollfd fds[4];
    nfds_t n = 0;
    auto add = [&](int fd, bool open) {
      if (open && fd >= 0) fds[n++] = pollfd{fd, POLLIN, 0};
    };
    add(child.out_, out_open);
    add(child.err_, err_open);
    add(child.rep_, rep_open);
    add(child.pidfd_, !ended);
    ::poll(fds, n, 100);
    std::string chunk;
    if (out_open) {
      out_open = read_some(child.out_, chunk);
      take_output(chunk, false);
    }
    if (err_open) {
      err_open = read_some(child.err_, chunk);
      take_output(chunk, true);
    }
    if (rep_open) {
      rep_open = read_some(child.rep_, chunk);
      take_reports(chunk);
    }
    if (!ended && child.exited()) {
      ended = true;
      exited_at = Clock::now();
    }
    if (!ended) {
      if (!outcome.stopped && run.should_stop && run.should_stop()) {
        outcome.stopped = true;
        term_sent = Clock::now();
        ::kill(-pid, SIGTERM);
        spdlog::info("program pid {}: SIGTERM sent to its group", pid);
      } else if (term_sent && !killed && Clock::now() - *term_sent >= run.stop_grace) {
        ::kill(-pid, SIGKILL);
        killed = true;
        spdlog::warn("program pid {}: still running {} ms after SIGTERM; SIGKILL sent", pid,
                     run.stop_grace.count());
      }
      continue;
    }
    // Ended: read what is left, but not for ever (a process that left the
    // group may hold a pipe open).
    if ((!out_open && !err_open && !rep_open) || Clock::now() - *exited_at > kDrainAfterExit) {
      break;
    }
  }
  outcome.exit_code = child.exit_code();
  spdlog::info("program pid {} ended with status {}{}", pid, outcome.exit_code,
               outcome.stopped ? " (stopped)" : "");
  return outcome;
}

ProgramOutcome run_program(const proto::ProgramSpec& program, const ProgramRun& run) {
  ProgramLaunch launch;
  launch.dir = program.directory()->str();
  struct stat st {};
  if (::stat(launch.dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    throw std::runtime_error("program.directory: " + printable(launch.dir) +
                             " is not a folder here (" + errno_text(errno) + ")");
  }
  std::string path_var;
  launch.env = program_environment(&program, run, path_var);
  launch.exe = find_program(program.command()->Get(0)->str(), launch.dir, path_var);
  for (const auto* a : *program.command()) launch.argv.push_back(a->str());
  ProgramChild child = start_program(launch);
  spdlog::info("program started: pid {}, {} in {}", child.pid(), printable(launch.exe),
               printable(launch.dir));
  return supervise(child, run);
}

}  // namespace leasehold
