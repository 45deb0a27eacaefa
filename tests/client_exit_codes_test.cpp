// The client's exit statuses are the table in client/exit_codes.h (and the
// README's): each row is held here by the command that should produce it.
#include <gtest/gtest.h>

#include <fstream>

#include "client/exit_codes.h"
#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace leasehold::client;

class ClientExitCodes : public ::testing::Test {
 protected:
  std::pair<int, std::string> leasehold(std::vector<std::string> args) {
    args.insert(args.begin(), {"--endpoint", cluster.endpoint()});
    return cluster.run("leasehold", args);
  }
  std::string write(const std::string& name, const std::string& text) {
    const std::string path = cluster.dir() + "/" + name;
    std::ofstream(path) << text;
    return path;
  }
  Cluster cluster;
};

TEST_F(ClientExitCodes, EveryRowOfTheTable) {
  write_synthetic_idx(cluster.dir(), "train", 300, 1);
  write_synthetic_idx(cluster.dir(), "test", 60, 2);
  const std::string good =
      write("good.json", synthetic_job_json(cluster.dir(), "good", R"(, "epochs": 1)"));
  std::string relu = synthetic_job_json(cluster.dir(), "bad", R"(, "epochs": 1)");
  relu.replace(relu.find("\"ReLU\""), 6, "\"Relu\"");
  const std::string bad = write("bad.json", relu);

  // Before any coordinator exists.
  EXPECT_EQ(leasehold({"--help"}).first, kExitOk);
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"no-such-command"}, {"job"}, {"logs", "abc"}, {"job", "-1"}, {"status", "--bogus"}}) {
    auto [rc, out] = leasehold(args);
    EXPECT_EQ(rc, kExitInvalid) << args[0] << ": " << out;
  }
  auto [missing_rc, missing] = leasehold({"submit", cluster.dir() + "/absent.json"});
  EXPECT_EQ(missing_rc, kExitInvalid) << missing;
  EXPECT_NE(missing.find("cannot read job file"), std::string::npos) << missing;
  // A bad file is the user's to fix first, coordinator or not.
  auto [bad_rc, bad_out] = leasehold({"submit", bad});
  EXPECT_EQ(bad_rc, kExitInvalid) << bad_out;
  EXPECT_NE(bad_out.find("did you mean ReLU?"), std::string::npos) << bad_out;
  for (const auto& args : std::vector<std::vector<std::string>>{
           {"status"}, {"jobs"}, {"job", "1"}, {"submit", good}, {"regions"}}) {
    auto [rc, out] = leasehold(args);
    EXPECT_EQ(rc, kExitUnreachable) << args[0] << ": " << out;
  }

  cluster.start_coordinator({"--backend", "host", "--pool-size", "64MiB"});
  EXPECT_EQ(leasehold({"status"}).first, kExitOk);
  EXPECT_EQ(leasehold({"job", "999"}).first, kExitInvalid);
  EXPECT_EQ(leasehold({"cancel", "999"}).first, kExitInvalid);
  EXPECT_EQ(leasehold({"regions", "drop", "dataset/none"}).first, kExitInvalid);
  // Refused by the coordinator, which knows the pool: less than one lease.
  const std::string tiny = write(
      "tiny.json", synthetic_job_json(cluster.dir(), "tiny", R"(, "epochs": 1, "memory_budget": "1MiB")"));
  auto [tiny_rc, tiny_out] = leasehold({"submit", tiny});
  EXPECT_EQ(tiny_rc, kExitInvalid) << tiny_out;
  EXPECT_NE(tiny_out.find("less than one lease"), std::string::npos) << tiny_out;
  // Queued (no agent), then cancelled: a follower of it exits 3.
  auto [rc, id] = leasehold({"submit", good});
  ASSERT_EQ(rc, kExitOk) << id;
  id.erase(id.find_last_not_of("\n") + 1);
  EXPECT_EQ(leasehold({"cancel", id}).first, kExitOk);
  auto [follow_rc, follow] = leasehold({"job", id});
  EXPECT_EQ(follow_rc, kExitOk) << follow;
  EXPECT_NE(follow.find("cancelled by"), std::string::npos) << follow;
  // Ids are decimal: a leading zero is not octal.
  auto [zero_rc, zero] = leasehold({"job", "0" + id});
  EXPECT_EQ(zero_rc, kExitOk) << zero;
  auto [octal_rc, octal] = leasehold({"cancel", "010"});
  EXPECT_EQ(octal_rc, kExitInvalid) << octal;
  EXPECT_NE(octal.find("no job with id 10"), std::string::npos) << "not job 8: " << octal;
  // With an agent a followed job runs to its end: 0.
  cluster.start_agent("worker", {});
  auto [done_rc, done] = leasehold({"submit", "--follow", good});
  EXPECT_EQ(done_rc, kExitOk) << done;
}

}  // namespace
}  // namespace leasehold::testing
