// Who may do what, with real processes and real users: the coordinator
// learns each ipc:// peer's uid from the kernel. Clients and agents run as
// `nobody` through setpriv(1); skipped with a message where the test
// cannot switch user (not root, no setpriv).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

constexpr const char* kSetpriv = "/usr/bin/setpriv";
constexpr uid_t kNobody = 65534;

class Access : public ::testing::Test {
 protected:
  void SetUp() override {
    if (::geteuid() != 0 || ::access(kSetpriv, X_OK) != 0) {
      GTEST_SKIP() << "needs root and setpriv(1) to run a client as nobody";
    }
    write_synthetic_idx(c.dir(), "train", 600, 1);
    write_synthetic_idx(c.dir(), "test", 150, 2);
  }
  void start(std::vector<std::string> args) {
    args.insert(args.end(), {"--backend", "host", "--pool-size", "64MiB", "--alignment", "1MiB"});
    c.start_coordinator(args);
    // Let nobody reach the socket and read the job files: the groups are
    // what is tested, not the file modes.
    fs::permissions(c.dir(), fs::perms::all, fs::perm_options::add);
    for (const auto& e : fs::directory_iterator(c.dir())) {
      std::error_code ec;
      fs::permissions(e.path(), fs::perms::all, fs::perm_options::add, ec);
    }
  }
  std::string job_file(const std::string& name) {
    const std::string path = c.dir() + "/" + name + ".json";
    std::ofstream(path) << synthetic_job_json(c.dir(), name, R"(, "epochs": 1)");
    fs::permissions(path, fs::perms::all, fs::perm_options::add);
    return path;
  }
  // Runs a program of the build as `nobody`.
  std::pair<int, std::string> as_nobody(const std::string& program, std::vector<std::string> args) {
    std::vector<std::string> argv{"--reuid=" + std::to_string(kNobody),
                                  "--regid=" + std::to_string(kNobody), "--clear-groups",
                                  bin_dir() + "/" + program};
    argv.insert(argv.end(), args.begin(), args.end());
    return c.run_path(kSetpriv, argv);
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    args.insert(args.begin(), {"--endpoint", c.endpoint()});
    return c.run("leasehold", args);
  }
  Cluster c;
};

TEST_F(Access, AnotherUserCannotCancelYourJob) {
  start({});
  auto [rc, out] = client({"submit", job_file("mine")});
  ASSERT_EQ(rc, 0) << out;
  auto [rc2, out2] = as_nobody("leasehold", {"--endpoint", c.endpoint(), "cancel", "1"});
  EXPECT_EQ(rc2, 5) << "permission denied (client/exit_codes.h): " << out2;
  EXPECT_NE(out2.find("job 1 was submitted by root"), std::string::npos) << out2;
  EXPECT_NE(out2.find("nobody (uid 65534)"), std::string::npos) << "the kernel's word, not the client's: " << out2;
  auto [rc3, job] = client({"job", "1", "-o", "json"});
  ASSERT_EQ(rc3, 0) << job;
  const auto j = nlohmann::json::parse(job);
  EXPECT_EQ(j["submitted_by"], "root");
  EXPECT_NE(j["state"], "cancelled") << "unchanged";
  // Nor fetch its checkpoint: a job's results are its submitter's.
  auto [rc5, out5] = as_nobody("leasehold", {"--endpoint", c.endpoint(), "checkpoint", "1", "-o",
                                             "/tmp/leasehold-stolen.ckpt"});
  EXPECT_EQ(rc5, 5) << out5;
  EXPECT_NE(out5.find("job 1 was submitted by root"), std::string::npos) << out5;
  EXPECT_FALSE(fs::exists("/tmp/leasehold-stolen.ckpt"));
  // Reading is open to anyone who reaches the socket.
  auto [rc4, status] = as_nobody("leasehold", {"--endpoint", c.endpoint(), "status"});
  EXPECT_EQ(rc4, 0) << status;
}

// An agent runs other users' jobs and reports their results: without
// agent_group only root and the coordinator's user register one; opening
// registration to anyone is an explicit agent_group = "*".
TEST_F(Access, OnlyTheCoordinatorsUserRegistersAgentsUnlessOpenedUp) {
  start({});
  auto [rc, agent] = as_nobody("leasehold-agent", {"--endpoint", c.endpoint(), "--name",
                                                   "stranger", "--exercise", "--rounds", "1"});
  EXPECT_NE(rc, 0) << agent;
  EXPECT_NE(agent.find("nobody (uid 65534) may not register as an agent: only root and the "
                       "coordinator's user may (agent_group is not set"),
            std::string::npos)
      << agent;
  auto status = c.status();
  ASSERT_TRUE(status);
  EXPECT_TRUE((*status)["agents"].empty());
}

TEST_F(Access, AgentGroupStarLetsAnyoneWhoReachesTheSocketRegister) {
  start({"--agent-group", "*"});
  // Registered; whether it can then fetch its leases' chunks is up to the
  // chunk socket's file mode, as the endpoint's is.
  auto [rc, agent] = as_nobody("leasehold-agent", {"--endpoint", c.endpoint(), "--name",
                                                   "guest", "--exercise", "--rounds", "1",
                                                   "--register-timeout", "2s"});
  EXPECT_EQ(agent.find("may not register as an agent"), std::string::npos) << agent;
  EXPECT_NE(c.processes()[0]->log().find("agent 'guest' (pid"), std::string::npos)
      << c.processes()[0]->log();
}

TEST_F(Access, GroupsDecideWhoSubmitsAndWhoServes) {
  // nobody is in neither group; root always passes.
  start({"--client-group", "root", "--agent-group", "root"});
  auto [rc, out] = as_nobody("leasehold", {"--endpoint", c.endpoint(), "submit", job_file("x")});
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("is not in client_group 'root'"), std::string::npos) << out;
  auto [rca, agent] = as_nobody("leasehold-agent", {"--endpoint", c.endpoint(), "--name",
                                                    "intruder", "--exercise"});
  EXPECT_NE(rca, 0) << agent;
  EXPECT_NE(agent.find("is not in agent_group 'root'"), std::string::npos) << agent;
  auto status = c.status();
  ASSERT_TRUE(status);
  EXPECT_TRUE((*status)["agents"].empty()) << "nothing registered";
  auto [rcj, jobs] = client({"jobs", "-o", "json"});
  EXPECT_EQ(jobs, "[]\n") << "nothing queued";
  // root may.
  auto [rc2, out2] = client({"submit", job_file("y")});
  EXPECT_EQ(rc2, 0) << out2;
}

// The socket file's mode keeps other users out before any message: the
// client says so at once, not as a coordinator that does not answer.
TEST_F(Access, TheSocketModeKeepsOtherUsersOutAndSaysSo) {
  c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--alignment", "1MiB"});
  // A folder on the way that nobody may search (mkdtemp's 0700): said so,
  // not "does not exist".
  auto [rc0, out0] = as_nobody("leasehold", {"--endpoint", c.endpoint(), "status"});
  EXPECT_NE(rc0, 0);
  EXPECT_NE(out0.find("a folder on its path may not be searched"), std::string::npos) << out0;
  fs::permissions(c.dir(), fs::perms::all, fs::perm_options::add);
  const std::string socket = c.dir() + "/coordinator.sock";
  struct stat st {};
  ASSERT_EQ(::stat(socket.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0660u) << "socket_mode's default";
  const auto t0 = std::chrono::steady_clock::now();
  auto [rc, out] =
      as_nobody("leasehold", {"--endpoint", c.endpoint(), "--timeout", "60s", "status"});
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("permission denied connecting to " + socket + " (mode 0660, owner root"),
            std::string::npos)
      << out;
  EXPECT_EQ(out.find("no reply"), std::string::npos) << out;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 30s) << "at once, not after the timeout";
  auto [rca, agent] = as_nobody("leasehold-agent", {"--endpoint", c.endpoint(), "--name",
                                                    "outsider", "--exercise"});
  EXPECT_NE(rca, 0) << agent;
  EXPECT_NE(agent.find("permission denied connecting to"), std::string::npos) << agent;
}

TEST_F(Access, SocketGroupLetsItsMembersConnect) {
  // nobody's own group (nogroup, 65534) is given the socket.
  const std::string group = "nogroup";
  c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--alignment", "1MiB",
                       "--socket-group", group});
  fs::permissions(c.dir(), fs::perms::all, fs::perm_options::add);
  struct stat st {};
  ASSERT_EQ(::stat((c.dir() + "/coordinator.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_gid, kNobody);
  EXPECT_EQ(st.st_mode & 07777, 0660u);
  auto [rc, out] = as_nobody("leasehold", {"--endpoint", c.endpoint(), "status"});
  EXPECT_EQ(rc, 0) << out;
}

TEST_F(Access, AnUnknownGroupIsAStartUpErrorNamingIt) {
  auto [rc, out] = c.run("leasehold-coordinator",
                         {"--endpoint", c.endpoint(), "--state-dir", c.state_dir(), "--backend",
                          "host", "--pool-size", "64MiB", "--mps", "off", "--http", "off",
                          "--admin-group", "no-such-group-here"});
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("admin_group: no group named 'no-such-group-here'"), std::string::npos)
      << out;
}

}  // namespace
}  // namespace leasehold::testing
