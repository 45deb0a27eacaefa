#include "coordinator/mps_daemon.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string_view>
#include <thread>
#include <vector>

extern char** environ;

namespace leasehold {
namespace {

namespace fs = std::filesystem;

// Runs `program ARGS` with the MPS folders in its environment and `input`
// on its standard input; returns its exit status (127: it could not be
// run; -1: it did not end within `timeout`, then killed). Its output goes
// to /dev/null (a daemon it forks must not hold our output open).
constexpr int kCannotRun = 127;
int run_control(const std::string& program, const std::vector<std::string>& args,
                const std::string& pipe_dir, const std::string& log_dir, const std::string& input,
                std::chrono::milliseconds timeout) {
  // Everything the child needs is built before the fork: the process has
  // threads (ZeroMQ's), so the child may only call async-signal-safe
  // functions until it execs.
  std::vector<std::string> env_text;
  for (char** e = environ; *e; ++e) {
    std::string_view v(*e);
    if (v.rfind("CUDA_MPS_PIPE_DIRECTORY=", 0) != 0 && v.rfind("CUDA_MPS_LOG_DIRECTORY=", 0) != 0) {
      env_text.emplace_back(v);
    }
  }
  env_text.push_back("CUDA_MPS_PIPE_DIRECTORY=" + pipe_dir);
  if (!log_dir.empty()) env_text.push_back("CUDA_MPS_LOG_DIRECTORY=" + log_dir);
  std::vector<char*> envp, argv{const_cast<char*>(program.c_str())};
  for (auto& e : env_text) envp.push_back(e.data());
  envp.push_back(nullptr);
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  int in[2];
  if (::pipe2(in, O_CLOEXEC) != 0) return -1;
  const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC);
  pid_t pid = ::fork();
  if (pid < 0) {
    ::close(in[0]);
    ::close(in[1]);
    if (null >= 0) ::close(null);
    return -1;
  }
  if (pid == 0) {
    ::dup2(in[0], STDIN_FILENO);  // dup2 clears close-on-exec on the copies
    if (null >= 0) {
      ::dup2(null, STDOUT_FILENO);
      ::dup2(null, STDERR_FILENO);
    }
    ::signal(SIGPIPE, SIG_DFL);  // the coordinator ignores it; the daemon should not
    ::execve(program.c_str(), argv.data(), envp.data());
    ::_exit(kCannotRun);
  }
  if (null >= 0) ::close(null);
  ::close(in[0]);
  if (!input.empty()) {
    [[maybe_unused]] ssize_t n = ::write(in[1], input.data(), input.size());
  }
  ::close(in[1]);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  int status = 0;
  while (true) {
    pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0 && errno != EINTR) return -1;
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

void make_private_dir(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir)) {
    throw std::runtime_error("cannot create the MPS folder " + dir + ": " +
                             (ec ? ec.message() : "not a directory"));
  }
  ::chmod(dir.c_str(), 0700);
}

}  // namespace

std::optional<std::string> find_mps_control() {
  const char* path = std::getenv("PATH");
  std::stringstream dirs(path ? path : "");
  for (std::string d; std::getline(dirs, d, ':');) {
    if (d.empty()) continue;
    std::string candidate = d + "/nvidia-cuda-mps-control";
    if (::access(candidate.c_str(), X_OK) == 0) return candidate;
  }
  return std::nullopt;
}

std::unique_ptr<MpsDaemon> MpsDaemon::start(const std::string& control, const std::string& dir) {
  const std::string pipe_dir = dir + "/mps-pipe", log_dir = dir + "/mps-log";
  make_private_dir(pipe_dir);
  make_private_dir(log_dir);
  auto answers = [&] {
    return run_control(control, {}, pipe_dir, log_dir, "get_server_list\n",
                       std::chrono::seconds(5)) == 0;
  };
  if (fs::exists(pipe_dir + "/control")) {
    if (answers()) {
      spdlog::info("using the MPS control daemon already running in {}", pipe_dir);
      return std::unique_ptr<MpsDaemon>(new MpsDaemon(pipe_dir, control, dir));
    }
    // Left by a daemon that is gone.
    std::error_code ec;
    fs::remove(pipe_dir + "/control", ec);
  }
  // -d: it forks the daemon and returns.
  int rc = run_control(control, {"-d"}, pipe_dir, log_dir, "", std::chrono::seconds(30));
  if (rc == kCannotRun) throw std::runtime_error("cannot run " + control);
  if (rc != 0) {
    throw std::runtime_error(control + " -d failed (exit status " + std::to_string(rc) + "); see " +
                             log_dir + "/control.log, or set mps = off");
  }
  bool up = false;
  for (int i = 0; i < 200 && !up; ++i) {
    up = fs::exists(pipe_dir + "/control") && answers();
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(25));
  }
  if (!up) {
    throw std::runtime_error("the MPS control daemon started by " + control +
                             " does not answer on " + pipe_dir + " (see " + log_dir +
                             "/control.log)");
  }
  spdlog::info(
      "MPS control daemon started (pipe {}, log {}); it outlives this coordinator: "
      "stop it with 'echo quit | CUDA_MPS_PIPE_DIRECTORY={} {}'",
      pipe_dir, log_dir, pipe_dir, control);
  return std::unique_ptr<MpsDaemon>(new MpsDaemon(pipe_dir, control, dir));
}

std::unique_ptr<MpsDaemon> MpsDaemon::attach(const std::string& pipe_dir) {
  if (!fs::exists(pipe_dir + "/control")) {
    throw std::runtime_error("mps_directory " + pipe_dir +
                             " has no MPS control pipe (is the daemon running with "
                             "CUDA_MPS_PIPE_DIRECTORY=" +
                             pipe_dir + "?)");
  }
  spdlog::info("using the MPS control daemon of {}", pipe_dir);
  return std::unique_ptr<MpsDaemon>(new MpsDaemon(pipe_dir, "", ""));
}

bool MpsDaemon::alive() const {
  const std::string path = pipe_dir_ + "/control";
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) return fs::exists(path);
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return true;  // cannot tell: assume it is there
  // Only "nobody listens" means gone (the daemon's socket type may differ
  // from ours: then connect fails with EPROTOTYPE, but it is there; a full
  // backlog answers EAGAIN at once, it never blocks the loop).
  const bool gone = ::connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0 &&
                    (errno == ECONNREFUSED || errno == ENOENT);
  ::close(fd);
  return !gone;
}

bool MpsDaemon::restart() {
  if (control_.empty()) return false;
  spdlog::warn("the MPS control daemon of {} does not accept connections; starting it again",
               pipe_dir_);
  try {
    auto again = start(control_, dir_);  // logs whether it started one
    pipe_dir_ = again->pipe_dir_;
    return true;
  } catch (const std::exception& e) {
    spdlog::error("MPS control daemon in {} is gone and cannot be started again: {}", pipe_dir_,
                  e.what());
    return false;
  }
}

}  // namespace leasehold
