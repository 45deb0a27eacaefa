#include "tests/support/cluster.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>
#include <tuple>

#include <zmq.hpp>

#include "client/status_format.h"
#include "shared/connection.h"
#include "shared/curve_keys.h"
#include "tests/support/net.h"
#include "shared/process.h"

extern char** environ;

namespace leasehold::testing {

std::string bin_dir() {
  if (const char* env = std::getenv("LEASEHOLD_BIN_DIR"); env && *env) return env;
  return LEASEHOLD_BUILD_BIN_DIR;
}

std::string test_backend() {
  if (const char* env = std::getenv("LEASEHOLD_TEST_BACKEND"); env && *env) return env;
  return "host";
}

Process::Process(std::vector<std::string> argv, std::string log_path)
    : log_path_(std::move(log_path)) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND,
                                   0644);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  int rc = posix_spawn(&pid_, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc != 0) throw std::runtime_error("cannot start " + argv[0] + ": " + std::strerror(rc));
}

Process::~Process() {
  if (running()) {
    ::kill(pid_, SIGKILL);
    wait(std::chrono::seconds(5));
  }
}

void Process::signal(int sig) const { ::kill(pid_, sig); }

std::optional<int> Process::wait(std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!status_) {
    int st = 0;
    pid_t r = waitpid(pid_, &st, WNOHANG);
    if (r == pid_) {
      status_ = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      break;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return status_;
}

bool Process::running() { return !wait(std::chrono::milliseconds(0)).has_value(); }

std::string Process::describe() const {
  auto state = process_state(pid_);
  return "pid " + std::to_string(pid_) + (state ? std::string(" state ") + *state : " gone");
}

std::string Process::log() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Process::wait_for_log(const std::string& text, std::chrono::milliseconds timeout) const {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (log().find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return true;
}

Cluster::Cluster() {
  char tmpl[] = "/tmp/leasehold-test-XXXXXX";
  if (!mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
  dir_ = tmpl;
  endpoint_ = "ipc://" + dir_ + "/coordinator.sock";
}

Cluster::~Cluster() {
  // Agents first, so they do not log a lost coordinator; then the rest.
  for (auto it = procs_.rbegin(); it != procs_.rend(); ++it) {
    if ((*it)->running()) (*it)->signal(SIGTERM);
  }
  for (auto& p : procs_) {
    if (!p->wait(std::chrono::seconds(5))) p->signal(SIGKILL);
  }
  procs_.clear();
  if (!std::getenv("LEASEHOLD_KEEP_TEST_DIRS")) {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
}

void Cluster::use_curve() {
  std::filesystem::create_directories(key_dir() + "/allowed/agents");
  write_curve_key_pair(key_dir() + "/coordinator", generate_curve_key_pair());
  write_curve_key_pair(key_dir() + "/cluster", generate_curve_key_pair());
  // Allowed as a client and as an agent.
  std::filesystem::copy_file(key_dir() + "/cluster.pub", key_dir() + "/allowed/cluster.pub");
  std::filesystem::copy_file(key_dir() + "/cluster.pub",
                             key_dir() + "/allowed/agents/cluster.pub");
  endpoint_ = "tcp://127.0.0.1:" + std::to_string(free_port());
  events_endpoint_ = "tcp://127.0.0.1:" + std::to_string(free_port());
  coordinator_flags_ = {"--events-endpoint", events_endpoint_,
                        "--curve-key", key_dir() + "/coordinator", "--curve-allowed-keys",
                        key_dir() + "/allowed"};
  curve_ = true;
}

std::vector<std::string> Cluster::curve_flags(const std::string& key_name) const {
  return {"--curve-key", key_dir() + "/" + key_name, "--curve-server-key",
          key_dir() + "/coordinator.pub"};
}

Process& Cluster::start_coordinator(std::vector<std::string> args) {
  // No MPS daemon unless a test asks for one (one started in this private
  // folder would outlive the test).
  if (std::find(args.begin(), args.end(), "--mps") == args.end() &&
      std::find(args.begin(), args.end(), "--mps-directory") == args.end()) {
    args.insert(args.end(), {"--mps", "off"});
  }
  // No HTTP endpoint unless a test asks for one: tests run in parallel,
  // and the default port is one for the whole machine.
  if (std::find(args.begin(), args.end(), "--http") == args.end()) {
    args.insert(args.end(), {"--http", "off"});
  }
  std::vector<std::string> argv{bin_dir() + "/leasehold-coordinator", "--endpoint", endpoint_};
  argv.insert(argv.end(), coordinator_flags_.begin(), coordinator_flags_.end());
  // A private job store, kept across restarts of this cluster's coordinator.
  if (std::find(args.begin(), args.end(), "--state-dir") == args.end()) {
    argv.insert(argv.end(), {"--state-dir", state_dir()});
  }
  argv.insert(argv.end(), args.begin(), args.end());
  procs_.push_back(std::make_unique<Process>(
      argv, dir_ + "/coordinator-" + std::to_string(counter_++) + ".log"));
  Process& p = *procs_.back();
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (!p.running()) throw std::runtime_error("coordinator exited at start:\n" + p.log());
    if (status(std::chrono::milliseconds(200))) return p;
  }
  throw std::runtime_error("coordinator did not answer within 10 s:\n" + p.log());
}

Process& Cluster::start_agent(const std::string& name, std::vector<std::string> args) {
  std::vector<std::string> argv{bin_dir() + "/leasehold-agent", "--endpoint", endpoint_, "--name",
                                name};
  if (curve_ && std::find(args.begin(), args.end(), "--curve-key") == args.end()) {
    auto flags = curve_flags();
    argv.insert(argv.end(), flags.begin(), flags.end());
  }
  argv.insert(argv.end(), args.begin(), args.end());
  // Spill files stay inside the cluster's folder, and test agents pin less.
  auto has = [&](const char* flag) { return std::find(args.begin(), args.end(), flag) != args.end(); };
  if (!has("--spill-dir")) argv.insert(argv.end(), {"--spill-dir", dir_ + "/spill"});
  if (!has("--spill-host-bytes")) argv.insert(argv.end(), {"--spill-host-bytes", "32MiB"});
  if (!has("--spill-staging-bytes")) argv.insert(argv.end(), {"--spill-staging-bytes", "8MiB"});
  procs_.push_back(std::make_unique<Process>(argv, dir_ + "/agent-" + name + "-" +
                                                       std::to_string(counter_++) + ".log"));
  return *procs_.back();
}

std::pair<int, std::string> Cluster::run(const std::string& program,
                                         std::vector<std::string> args) {
  return run_path(bin_dir() + "/" + program, std::move(args));
}

std::pair<int, std::string> Cluster::run_path(const std::string& program,
                                              std::vector<std::string> args) {
  std::vector<std::string> argv{program};
  argv.insert(argv.end(), args.begin(), args.end());
  std::string log = dir_ + "/run-" + std::to_string(counter_++) + ".log";
  Process p(argv, log);
  // A bound for a hang, not a speed test: `submit --follow` trains a job,
  // which under ASan on two busy cores took over 30 s.
  auto rc = p.wait(std::chrono::seconds(180));
  if (!rc) throw std::runtime_error(program + " did not finish within 180 s");
  return {*rc, p.log()};
}

std::optional<nlohmann::json> Cluster::status(std::chrono::milliseconds timeout) {
  static zmq::context_t ctx(1);
  std::optional<CurveClientKeys> keys;
  if (curve_) {
    keys = CurveClientKeys{read_curve_public_key(key_dir() + "/coordinator.pub"),
                           read_curve_key_pair(key_dir() + "/cluster")};
  }
  Connection conn(ctx, endpoint_, "test-status", keys);
  try {
    auto reply = conn.request(
        [](flatbuffers::FlatBufferBuilder& fbb) {
          return std::pair{proto::Body::StatusRequest, proto::CreateStatusRequest(fbb).Union()};
        },
        timeout);
    const auto* s = reply->body_as_StatusReply();
    if (!s) return std::nullopt;
    return status_to_json(*s);
  } catch (const Error&) {
    return std::nullopt;
  }
}

bool Cluster::wait_for(const std::function<bool(const nlohmann::json&)>& pred,
                       std::chrono::milliseconds timeout) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  do {
    if (auto s = status(std::chrono::milliseconds(500)); s && pred(*s)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  } while (std::chrono::steady_clock::now() < deadline);
  return false;
}

std::pair<int, std::string> Cluster::client(std::vector<std::string> args) {
  args.insert(args.begin(), {"--endpoint", endpoint_});
  return run("leasehold", args);
}

nlohmann::json Cluster::job(uint64_t id) {
  auto [rc, out] = client({"job", std::to_string(id), "-o", "json"});
  return rc == 0 ? nlohmann::json::parse(out) : nlohmann::json();
}

bool Cluster::wait_job(uint64_t id, const std::function<bool(const nlohmann::json&)>& pred,
                       std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline) {
    if (auto j = job(id); !j.is_null() && pred(j)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

size_t idle_agents(const nlohmann::json& status) {
  size_t n = 0;
  for (const auto& a : status["agents"]) n += a["state"] == "idle";
  return n;
}

bool has_agent(const nlohmann::json& status, const std::string& name) {
  for (const auto& a : status["agents"]) {
    if (a["name"] == name) return true;
  }
  return false;
}

uint64_t leased_by(const nlohmann::json& status, const std::string& agent) {
  uint64_t total = 0;
  for (const auto& l : status["leases"]) {
    if (l["agent"] == agent) total += l["size"].get<uint64_t>();
  }
  return total;
}

bool leases_disjoint(const nlohmann::json& status) {
  // (device, offset, size): each device's pool has offsets of its own.
  std::vector<std::tuple<int, uint64_t, uint64_t>> r;
  for (const auto& l : status["leases"]) r.emplace_back(l["device"], l["offset"], l["size"]);
  std::sort(r.begin(), r.end());
  for (size_t i = 1; i < r.size(); ++i) {
    const auto& [dev0, off0, size0] = r[i - 1];
    const auto& [dev1, off1, size1] = r[i];
    if (dev0 == dev1 && off0 + size0 > off1) return false;
  }
  return true;
}

}  // namespace leasehold::testing
