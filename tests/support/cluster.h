// Test support: real coordinator and agent processes on a private endpoint.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace leasehold::testing {

// Directory of the built programs: $LEASEHOLD_BIN_DIR, else the build tree's.
std::string bin_dir();
// The backend the job tests run their coordinator on: $LEASEHOLD_TEST_BACKEND
// (cuda on a GPU host), else host.
std::string test_backend();

// A child process whose stdout and stderr go to one log file.
class Process {
 public:
  Process(std::vector<std::string> argv, std::string log_path);
  ~Process();  // SIGKILLs a child that is still running
  Process(const Process&) = delete;
  Process& operator=(const Process&) = delete;

  pid_t pid() const { return pid_; }
  void signal(int sig) const;
  // Waits for exit; returns the exit code (128+signal when killed), or
  // nullopt if still running after `timeout`.
  std::optional<int> wait(std::chrono::milliseconds timeout);
  bool running();
  std::string log() const;
  // "pid 123 state S" from /proc, for failure messages ("gone" once reaped).
  std::string describe() const;
  // Polls the log until it contains `text`, or `timeout` passes.
  bool wait_for_log(const std::string& text, std::chrono::milliseconds timeout) const;

 private:
  pid_t pid_ = -1;
  std::optional<int> status_;
  std::string log_path_;
};

class Cluster {
 public:
  // Makes a private directory and endpoint. Nothing runs yet.
  Cluster();
  ~Cluster();

  const std::string& endpoint() const { return endpoint_; }

  // Serves on tcp://127.0.0.1 with CURVE instead of ipc://: writes the
  // coordinator's key pair and one for this cluster's agents and requests
  // (KEY_DIR/coordinator, KEY_DIR/cluster) and allows the latter as a
  // client and an agent (KEY_DIR/allowed and allowed/agents). Call before
  // start_coordinator.
  void use_curve();
  std::string key_dir() const { return dir_ + "/keys"; }
  // Set by use_curve (empty: the default beside the ipc socket).
  const std::string& events_endpoint() const { return events_endpoint_; }
  // --curve-key KEY_DIR/NAME --curve-server-key KEY_DIR/coordinator.pub
  std::vector<std::string> curve_flags(const std::string& key_name = "cluster") const;
  const std::string& dir() const { return dir_; }
  // The coordinator's state directory (job store, checkpoints): DIR/state
  // unless start_coordinator is given --state-dir.
  std::string state_dir() const { return dir_ + "/state"; }

  // Starts leasehold-coordinator with `args` (endpoint and state directory
  // added) and waits until it answers a status request.
  Process& start_coordinator(std::vector<std::string> args);
  Process& start_agent(const std::string& name, std::vector<std::string> args);
  // Runs a program to completion (throwing after 180 s, a hang); returns
  // {exit code, output}.
  std::pair<int, std::string> run(const std::string& program, std::vector<std::string> args);
  // The same for any program, by path.
  std::pair<int, std::string> run_path(const std::string& program, std::vector<std::string> args);

  // The coordinator's status as `leasehold status -o json` prints it;
  // nullopt when it does not answer within `timeout`.
  std::optional<nlohmann::json> status(std::chrono::milliseconds timeout = std::chrono::seconds(2));
  // Polls status until `pred` holds or `timeout` passes; returns whether it held.
  bool wait_for(const std::function<bool(const nlohmann::json&)>& pred,
                std::chrono::milliseconds timeout);
  // The `leasehold` client against this cluster's coordinator: {exit code, output}.
  std::pair<int, std::string> client(std::vector<std::string> args);
  // `leasehold job ID -o json`; null when the client fails.
  nlohmann::json job(uint64_t id);
  // Polls job `id` until `pred` holds or `timeout` passes; returns whether it held.
  bool wait_job(uint64_t id, const std::function<bool(const nlohmann::json&)>& pred,
                std::chrono::milliseconds timeout);

  std::vector<std::unique_ptr<Process>>& processes() { return procs_; }

 private:
  std::string dir_;
  std::string endpoint_;
  std::string events_endpoint_;
  std::vector<std::string> coordinator_flags_;  // the endpoints' own (CURVE)
  bool curve_ = false;
  std::vector<std::unique_ptr<Process>> procs_;
  int counter_ = 0;
};

// Agents in a status document standing by for a job (warmed up, no job).
size_t idle_agents(const nlohmann::json& status);
// Number of agents in a status document whose name is `name`.
bool has_agent(const nlohmann::json& status, const std::string& name);
// Sum of lease sizes held by `agent`.
uint64_t leased_by(const nlohmann::json& status, const std::string& agent);
// True when no two leases in `status` overlap.
bool leases_disjoint(const nlohmann::json& status);

}  // namespace leasehold::testing
