// Network endpoints: coordinator, agent and client over tcp://127.0.0.1 with
// CURVE, real processes on the host backend. A key the coordinator does not
// allow gets nothing, and the program holding it is told so at once.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shared/connection.h"
#include "shared/curve_keys.h"
#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

class Curve : public ::testing::Test {
 protected:
  void SetUp() override {
    write_synthetic_idx(c.dir(), "train", 600, 1);
    write_synthetic_idx(c.dir(), "test", 150, 2);
    c.use_curve();
  }
  void start() {
    c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--alignment", "1MiB"});
  }
  std::string job_file(const std::string& name) {
    const std::string path = c.dir() + "/" + name + ".json";
    std::ofstream(path) << synthetic_job_json(c.dir(), name, R"(, "epochs": 1)");
    return path;
  }
  // The client with `key`'s key pair.
  std::pair<int, std::string> client(const std::string& key, std::vector<std::string> args) {
    auto flags = c.curve_flags(key);
    flags.insert(flags.begin(),
                 {"--endpoint", c.endpoint(), "--events-endpoint", c.events_endpoint()});
    args.insert(args.begin(), flags.begin(), flags.end());
    return c.run("leasehold", args);
  }
  void keygen(const std::string& name) {
    auto [rc, out] = c.run("leasehold", {"keygen", c.key_dir() + "/" + name});
    ASSERT_EQ(rc, 0) << out;
  }
  size_t job_count() {
    auto [rc, out] = client("cluster", {"jobs", "-o", "json"});
    EXPECT_EQ(rc, 0) << out;
    return nlohmann::json::parse(out).size();
  }
  Cluster c;
};

TEST_F(Curve, AgentAndClientWithAllowedKeysRunAJobOverTcp) {
  start();
  c.start_agent("tcp-agent", {});
  ASSERT_TRUE(c.wait_for([](const nlohmann::json& s) { return idle_agents(s) == 1; }, 20s));
  auto [rc, out] = client("cluster", {"submit", "--follow", job_file("over-tcp")});
  ASSERT_EQ(rc, 0) << out;
  auto [rc2, job] = client("cluster", {"job", "1", "-o", "json"});
  ASSERT_EQ(rc2, 0) << job;
  const auto j = nlohmann::json::parse(job);
  EXPECT_EQ(j["state"], "succeeded");
  EXPECT_EQ(j["submitted_by"], "key cluster") << "recorded under the key's name";
  // Its submitter's key may cancel its own jobs; the kernel vouches for no
  // uid over tcp, so no other identity would do. (No agent: it stays queued.)
  c.processes()[1]->signal(SIGTERM);
  ASSERT_TRUE(c.processes()[1]->wait(10s));
  auto [rc3, out3] = client("cluster", {"submit", job_file("second")});
  ASSERT_EQ(rc3, 0) << out3;
  auto [rc4, out4] = client("cluster", {"cancel", "2"});
  EXPECT_EQ(rc4, 0) << out4;
  auto [rc5, job2] = client("cluster", {"job", "2", "-o", "json"});
  EXPECT_EQ(nlohmann::json::parse(job2)["state"], "cancelled") << job2;
}

TEST_F(Curve, AnUnknownKeyGetsNothing) {
  start();
  keygen("stranger");
  auto [rc, out] = client("stranger", {"submit", job_file("sneaky")});
  EXPECT_NE(rc, 0) << out;
  EXPECT_NE(out.find("refused this program's CURVE key"), std::string::npos) << out;
  EXPECT_EQ(out.find("no reply"), std::string::npos) << "told, not left waiting: " << out;
  auto& agent = c.start_agent("stranger-agent", c.curve_flags("stranger"));
  auto code = agent.wait(15s);
  ASSERT_TRUE(code) << "an agent with an unknown key gives up: " << agent.describe();
  EXPECT_NE(*code, 0);
  EXPECT_NE(agent.log().find("refused this program's CURVE key"), std::string::npos)
      << agent.log();

  // A raw socket with the unknown key: its request reaches nothing, and
  // nothing is queued or registered.
  zmq::context_t ctx(1);
  CurveClientKeys keys{read_curve_public_key(c.key_dir() + "/coordinator.pub"),
                       read_curve_key_pair(c.key_dir() + "/stranger")};
  Connection raw(ctx, c.endpoint(), "raw-stranger", keys);
  try {
    raw.request(
        [](flatbuffers::FlatBufferBuilder& fbb) {
          return std::pair{proto::Body::StatusRequest, proto::CreateStatusRequest(fbb).Union()};
        },
        2s);
    ADD_FAILURE() << "the coordinator answered an unknown key";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::PermissionDenied) << e.what();
  }
  EXPECT_EQ(job_count(), 0u);
  auto status = c.status();
  ASSERT_TRUE(status);
  EXPECT_TRUE((*status)["agents"].empty());
  EXPECT_TRUE(c.processes()[0]->wait_for_log("is not in curve_allowed_keys", 5s));

  // Allowing the key takes effect at the next handshake, without a restart.
  fs::copy_file(c.key_dir() + "/stranger.pub", c.key_dir() + "/allowed/stranger.pub");
  auto [rc2, out2] = client("stranger", {"status"});
  EXPECT_EQ(rc2, 0) << out2;
}

// The folders are the roles: a key directly in curve_allowed_keys is a
// client, one in curve_allowed_keys/agents an agent; neither can be the
// other. A folder others may write is not trusted.
TEST_F(Curve, KeysHaveTheRolesOfTheirFolders) {
  keygen("client-only");
  keygen("agent-only");
  fs::copy_file(c.key_dir() + "/client-only.pub", c.key_dir() + "/allowed/client-only.pub");
  fs::copy_file(c.key_dir() + "/agent-only.pub", c.key_dir() + "/allowed/agents/agent-only.pub");
  start();
  auto& impostor = c.start_agent("impostor", c.curve_flags("client-only"));
  ASSERT_TRUE(impostor.wait(15s)) << impostor.describe();
  EXPECT_NE(impostor.log().find("key client-only may not register as an agent"),
            std::string::npos)
      << impostor.log();
  auto [rc, out] = client("agent-only", {"submit", job_file("not-a-client")});
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("key agents/agent-only may not submit jobs"), std::string::npos) << out;
  EXPECT_EQ(job_count(), 0u);
  // Reading stays open to both.
  EXPECT_EQ(client("agent-only", {"status"}).first, 0);
  EXPECT_EQ(client("client-only", {"status"}).first, 0);
  // An agent's key whose file has a client's name is not that client: it
  // cannot cancel the client's job.
  keygen("namesake");
  fs::copy_file(c.key_dir() + "/namesake.pub", c.key_dir() + "/allowed/agents/client-only.pub");
  auto [rs, outs] = client("client-only", {"submit", job_file("mine")});
  ASSERT_EQ(rs, 0) << outs;
  auto [rn, outn] = client("namesake", {"cancel", "1"});
  EXPECT_NE(rn, 0);
  EXPECT_NE(outn.find("job 1 was submitted by key client-only"), std::string::npos) << outn;
  auto [rj, outj] = client("client-only", {"job", "1", "-o", "json"});
  EXPECT_EQ(nlohmann::json::parse(outj)["state"], "queued") << outj;
  // A key folder that others may write is not trusted, from the next
  // handshake on.
  fs::permissions(c.key_dir() + "/allowed", fs::perms::others_write, fs::perm_options::add);
  auto [rc2, out2] = client("client-only", {"status"});
  EXPECT_NE(rc2, 0);
  EXPECT_NE(out2.find("refused this program's CURVE key"), std::string::npos) << out2;
  EXPECT_TRUE(c.processes()[0]->wait_for_log("may be written by group or others", 5s));
}

TEST_F(Curve, ANetworkEndpointWithoutKeysIsAStartUpError) {
  auto [rc, out] =
      c.run("leasehold-coordinator", {"--endpoint", c.endpoint(), "--events-endpoint",
                                      "tcp://127.0.0.1:1", "--state-dir", c.state_dir(),
                                      "--backend", "host", "--pool-size", "64MiB", "--http", "off"});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find(c.endpoint() + " is a network endpoint, which Leasehold serves only with "
                                    "CURVE: set curve_key"),
            std::string::npos)
      << out;
  start();
  auto [rc2, out2] = c.run("leasehold", {"--endpoint", c.endpoint(), "status"});
  EXPECT_NE(rc2, 0);
  EXPECT_NE(out2.find("name this program's key pair (--curve-key"), std::string::npos) << out2;
  auto [rc3, out3] = c.run("leasehold-agent", {"--endpoint", c.endpoint(), "--exercise"});
  EXPECT_EQ(rc3, 2);
  EXPECT_NE(out3.find("--curve-key"), std::string::npos) << out3;
}

TEST_F(Curve, KeyFilesAreCheckedAndNeverOverwritten) {
  const std::string pair = c.key_dir() + "/cluster";
  auto contents = [](const std::string& path) {
    std::ifstream in(path);
    return std::string((std::istreambuf_iterator<char>(in)), {});
  };
  const std::string secret = contents(pair), pub = contents(pair + ".pub");
  ASSERT_NE(secret.find("secret-key"), std::string::npos);
  auto [rc, out] = c.run("leasehold", {"keygen", pair});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("exists; keygen never overwrites a key"), std::string::npos) << out;
  EXPECT_EQ(contents(pair), secret) << "the key pair is untouched";
  EXPECT_EQ(contents(pair + ".pub"), pub);

  struct stat st {};
  ASSERT_EQ(::stat(pair.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  fs::permissions(c.key_dir() + "/coordinator", fs::perms::group_read, fs::perm_options::add);
  auto [rc2, out2] =
      c.run("leasehold-coordinator",
            {"--endpoint", c.endpoint(), "--events-endpoint", "tcp://127.0.0.1:1", "--state-dir",
             c.state_dir(), "--backend", "host", "--pool-size", "64MiB", "--http", "off",
             "--curve-key", c.key_dir() + "/coordinator", "--curve-allowed-keys",
             c.key_dir() + "/allowed"});
  EXPECT_NE(rc2, 0);
  EXPECT_NE(out2.find("holds a secret key but has mode 0640"), std::string::npos) << out2;

  // A public key that is not one: named with its file.
  std::ofstream(c.key_dir() + "/allowed/broken.pub") << "public-key = \"short\"\n";
  EXPECT_THROW(read_curve_public_key(c.key_dir() + "/allowed/broken.pub"), std::runtime_error);
  // A key pair whose halves do not belong together.
  const auto a = generate_curve_key_pair(), b = generate_curve_key_pair();
  write_curve_key_pair(c.dir() + "/mixed", {a.public_key, b.secret_key});
  try {
    read_curve_key_pair(c.dir() + "/mixed");
    ADD_FAILURE() << "a mismatched key pair was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("does not belong to its secret-key"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace leasehold::testing
