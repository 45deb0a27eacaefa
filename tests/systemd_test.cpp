// systemd, checked: the units in deploy/systemd pass `systemd-analyze
// verify`, the sysusers file creates the service user, and a real
// coordinator speaks sd_notify as a Type=notify service with a watchdog
// must: READY=1 once its pool exists, WATCHDOG=1 while its loop turns and
// none while the loop is stuck, STATUS= lines, STOPPING=1 on SIGTERM.
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/cluster.h"

namespace leasehold::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs `command` in a shell; returns its exit code and its output (stdout
// and stderr).
std::pair<int, std::string> shell(const std::string& command) {
  FILE* f = ::popen((command + " 2>&1").c_str(), "r");
  if (!f) throw std::runtime_error("cannot run " + command);
  std::string out;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) out.append(buf, n);
  const int status = ::pclose(f);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128, out};
}

bool on_path(const std::string& program) {
  return std::system(("command -v " + program + " >/dev/null 2>&1").c_str()) == 0;
}

// Copies deploy/systemd/*.service into `dir`, the programs' paths pointing
// at this build (verify checks that ExecStart's program exists), and the
// MPS control daemon at /bin/true where the machine has none.
std::vector<std::string> staged_units(const fs::path& dir) {
  std::vector<std::string> units;
  for (const auto& e : fs::directory_iterator(fs::path(LEASEHOLD_SOURCE_DIR) / "deploy/systemd")) {
    if (e.path().extension() != ".service") continue;
    std::string text = read_file(e.path());
    auto replace_all = [&](const std::string& from, const std::string& to) {
      for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at + to.size())) {
        text.replace(at, from.size(), to);
      }
    };
    replace_all("/usr/local/bin/", bin_dir() + "/");
    if (!fs::exists("/usr/bin/nvidia-cuda-mps-control")) {
      replace_all("/usr/bin/nvidia-cuda-mps-control", "/bin/true");
    }
    std::ofstream(dir / e.path().filename()) << text;
    units.push_back((dir / e.path().filename()).string());
  }
  return units;
}

TEST(SystemdUnits, PassSystemdAnalyzeVerify) {
  if (!on_path("systemd-analyze")) GTEST_SKIP() << "systemd-analyze not installed (deploy/setup.sh installs systemd)";
  Cluster c;
  const auto units = staged_units(c.dir());
  ASSERT_GE(units.size(), 3u) << "coordinator, agent template and MPS units";
  std::string cmd = "systemd-analyze verify --man=no --generators=no";
  for (const auto& u : units) cmd += " '" + u + "'";
  auto [rc, out] = shell(cmd);
  EXPECT_EQ(rc, 0) << out;
  EXPECT_EQ(out, "") << "warnings count as failures";
  // The service user and its hardening are there.
  const std::string coordinator = read_file(fs::path(LEASEHOLD_SOURCE_DIR) /
                                            "deploy/systemd/leasehold-coordinator.service");
  for (const char* line : {"User=leasehold", "RuntimeDirectory=leasehold", "StateDirectory=leasehold",
                           "WatchdogSec=", "NoNewPrivileges=yes", "ProtectSystem=strict"}) {
    EXPECT_NE(coordinator.find(line), std::string::npos) << line;
  }
  EXPECT_EQ(coordinator.find("PrivateDevices=yes"), std::string::npos) << "would hide /dev/nvidia*";
  EXPECT_EQ(coordinator.find("MemoryDenyWriteExecute=yes"), std::string::npos)
      << "the CUDA driver JIT-compiles PTX";
}

// deploy/install.sh into a staging root: the programs (not the
// benchmarks), units whose ExecStart= and Documentation= name files it
// installed, the sysusers file, the configuration (never overwritten), the
// docs, and the standby agents and MPS it was asked for.
TEST(SystemdUnits, InstallPutsEverythingWhereTheUnitsExpectIt) {
  if (!on_path("cmake")) GTEST_SKIP() << "cmake not installed";
  Cluster c;
  const fs::path root = fs::path(c.dir()) / "root";
  const std::string install = std::string(LEASEHOLD_SOURCE_DIR) + "/deploy/install.sh --build-dir '" +
                              fs::path(bin_dir()).parent_path().string() + "' --root '" +
                              root.string() + "' --prefix /opt/leasehold";
  auto [rc, out] = shell(install + " --agents 3 --mps on");
  ASSERT_EQ(rc, 0) << out;
  const fs::path bin = root / "opt/leasehold/bin";
  for (const char* program : {"leasehold", "leasehold-coordinator", "leasehold-agent"}) {
    EXPECT_TRUE(fs::exists(bin / program)) << program << "\n" << out;
  }
  for (const auto& e : fs::directory_iterator(bin)) {
    EXPECT_EQ(e.path().filename().string().find("bench"), std::string::npos)
        << "benchmarks are not installed: " << e.path();
  }
  EXPECT_TRUE(fs::exists(root / "opt/leasehold/share/leasehold/python/leasehold"));
  EXPECT_TRUE(fs::exists(root / "usr/lib/sysusers.d/leasehold.conf"));
  // Every path a unit names is there.
  for (const char* unit : {"leasehold-coordinator.service", "leasehold-agent@.service",
                           "leasehold-mps.service"}) {
    const std::string text = read_file(root / "etc/systemd/system" / unit);
    ASSERT_FALSE(text.empty()) << unit;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      for (const std::string key : {"ExecStart=/opt/", "Documentation=file://"}) {
        if (!line.starts_with(key)) continue;
        std::string path = line.substr(line.find(key.ends_with("/opt/") ? "/opt/" : "file://"));
        if (path.starts_with("file://")) path = path.substr(7);
        path = path.substr(0, path.find(' '));
        EXPECT_TRUE(fs::exists(root / path.substr(1))) << unit << " names " << path;
      }
    }
    EXPECT_EQ(text.find("/usr/local/"), std::string::npos) << unit << " still names /usr/local";
  }
  const std::string config = read_file(root / "etc/leasehold/leasehold.toml");
  EXPECT_NE(config.find("\nmps_directory = \"/run/leasehold-mps/pipe\""), std::string::npos)
      << "MPS on: the coordinator uses the unit's daemon";
  EXPECT_EQ(read_file(root / "etc/leasehold/agents"), "3\n");
  EXPECT_NE(out.find("leasehold-agent@0 leasehold-agent@1 leasehold-agent@2"), std::string::npos)
      << out;
  // Again, over an operator's edited configuration: kept, the new example
  // beside it, and the number of agents remembered.
  std::ofstream(root / "etc/leasehold/leasehold.toml") << "# mine\n";
  auto [rc2, out2] = shell(install);
  ASSERT_EQ(rc2, 0) << out2;
  EXPECT_EQ(read_file(root / "etc/leasehold/leasehold.toml"), "# mine\n");
  EXPECT_TRUE(fs::exists(root / "etc/leasehold/leasehold.toml.new"));
  EXPECT_EQ(read_file(root / "etc/leasehold/agents"), "3\n");
  // A bad request changes nothing and says what was wrong.
  auto [rc3, out3] = shell(install + " --agents none");
  EXPECT_NE(rc3, 0);
  EXPECT_NE(out3.find("--agents must be a whole number"), std::string::npos) << out3;
}

TEST(SystemdUnits, SysusersCreatesTheServiceUserInTheVideoGroup) {
  if (!on_path("systemd-sysusers")) GTEST_SKIP() << "systemd-sysusers not installed";
  Cluster c;
  const fs::path root = fs::path(c.dir()) / "root";
  fs::create_directories(root / "etc");
  auto [rc, out] = shell("systemd-sysusers --root='" + root.string() + "' '" +
                         LEASEHOLD_SOURCE_DIR + "/deploy/systemd/leasehold.sysusers'");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(read_file(root / "etc/passwd").find("leasehold:x:"), std::string::npos);
  const std::string group = read_file(root / "etc/group");
  EXPECT_NE(group.find("leasehold:x:"), std::string::npos) << group;
  EXPECT_NE(group.find("video:x:"), std::string::npos) << group;
  EXPECT_NE(group.find(":leasehold\n"), std::string::npos) << "leasehold joins video: " << group;
}

// A datagram socket playing systemd's part: NOTIFY_SOCKET points at it.
class NotifySocket {
 public:
  explicit NotifySocket(const std::string& path) : path_(path) {
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::snprintf(addr.sun_path, sizeof addr.sun_path, "%s", path.c_str());
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
      throw std::runtime_error("cannot bind a datagram socket at " + path);
    }
  }
  ~NotifySocket() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  struct Message {
    Clock::time_point at;
    std::string text;
  };
  // Every message that arrives within `window`.
  std::vector<Message> collect(std::chrono::milliseconds window) {
    std::vector<Message> out;
    const auto end = Clock::now() + window;
    while (Clock::now() < end) {
      pollfd p{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - Clock::now());
      if (::poll(&p, 1, int(std::max<int64_t>(1, left.count()))) <= 0) continue;
      char buf[4096];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n > 0) out.push_back({Clock::now(), std::string(buf, size_t(n))});
    }
    return out;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

size_t count_with(const std::vector<NotifySocket::Message>& messages, const std::string& text) {
  size_t n = 0;
  for (const auto& m : messages) n += m.text.find(text) != std::string::npos;
  return n;
}

std::string all_of(const std::vector<NotifySocket::Message>& messages) {
  std::string s;
  for (const auto& m : messages) s += "[" + m.text + "] ";
  return s;
}

TEST(SystemdNotify, ReadyWithThePoolWatchdogFromTheLoopStatusAndStopping) {
  Cluster c;
  NotifySocket notify(c.dir() + "/notify");
  // The coordinator inherits these; a 300 ms watchdog is pinged every 100 ms.
  ::setenv("NOTIFY_SOCKET", (c.dir() + "/notify").c_str(), 1);
  ::setenv("WATCHDOG_USEC", "300000", 1);
  ::unsetenv("WATCHDOG_PID");
  Process& coordinator =
      c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--heartbeat-interval",
                           "100ms", "--test-stall-on-sigusr1", "3s"});
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");

  auto first = notify.collect(1500ms);
  ASSERT_FALSE(first.empty()) << coordinator.log();
  EXPECT_NE(first.front().text.find("READY=1"), std::string::npos) << all_of(first);
  // READY comes once the pool exists: its status line names the pool.
  EXPECT_NE(first.front().text.find("STATUS=serving; 0 agents, 0 leases, 0 B of 64.00 MiB leased"),
            std::string::npos)
      << all_of(first);
  EXPECT_EQ(count_with(first, "READY=1"), 1u) << all_of(first);
  EXPECT_GE(count_with(first, "WATCHDOG=1"), 3u) << "pings while the loop turns: " << all_of(first);

  // A loop stuck for 3 s sends no pings (systemd would restart it); once it
  // turns again the pings come back.
  coordinator.signal(SIGUSR1);
  std::this_thread::sleep_for(500ms);
  notify.collect(1ms);  // whatever was sent before the stall began
  auto stuck = notify.collect(1500ms);
  EXPECT_EQ(count_with(stuck, "WATCHDOG=1"), 0u) << "pings from a stuck loop: " << all_of(stuck);
  auto after = notify.collect(3000ms);
  EXPECT_GE(count_with(after, "WATCHDOG=1"), 1u) << "no pings after the stall: " << all_of(after);

  coordinator.signal(SIGTERM);
  auto last = notify.collect(3000ms);
  EXPECT_EQ(count_with(last, "STOPPING=1"), 1u) << all_of(last);
  EXPECT_NE(all_of(last).find("STATUS=stopping"), std::string::npos) << all_of(last);
  EXPECT_EQ(coordinator.wait(10s), 0) << coordinator.log();
}

}  // namespace
}  // namespace leasehold::testing
