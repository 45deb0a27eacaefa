// A real Prometheus (Debian's `prometheus`) scrapes a running coordinator
// with the scrape configuration and file-based discovery of deploy/prometheus/,
// and reports the same pool usage as `leasehold status -o json`.
#include <gtest/gtest.h>
#include <httplib.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "lease_client/session.h"
#include "tests/support/cluster.h"
#include "tests/support/net.h"

namespace leasehold::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::string find_program(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(std::string(path ? path : "") + ":/usr/bin:/usr/sbin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    if (!dir.empty() && ::access((dir + "/" + name).c_str(), X_OK) == 0) return dir + "/" + name;
  }
  return "";
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

void replace(std::string& text, const std::string& from, const std::string& to) {
  const auto at = text.find(from);
  ASSERT_NE(at, std::string::npos) << "deploy/prometheus/prometheus.yml lost \"" << from << "\"";
  text.replace(at, from.size(), to);
}

// One sample of an instant query; nullopt while Prometheus has none.
std::optional<nlohmann::json> query(int port, const std::string& promql) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(5, 0);
  auto res = c.Get("/api/v1/query", httplib::Params{{"query", promql}}, httplib::Headers{});
  if (!res || res->status != 200) return std::nullopt;
  auto j = nlohmann::json::parse(res->body, nullptr, false);
  if (j.is_discarded() || j["status"] != "success" || j["data"]["result"].empty()) {
    return std::nullopt;
  }
  return j["data"]["result"][0];
}

TEST(Prometheus, ScrapesPoolUsageThatMatchesTheClient) {
  const std::string prometheus = find_program("prometheus");
  if (prometheus.empty()) {
    GTEST_SKIP() << "prometheus is not installed (deploy/setup.sh --with-test-tools installs it)";
  }
  Cluster c;
  const int http = free_port();
  c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--alignment", "1MiB", "--http",
                       "127.0.0.1:" + std::to_string(http)});
  AgentOptions o;
  o.endpoint = c.endpoint();
  o.name = "holder";
  AgentSession agent(o);
  auto a = agent.acquire(3ull << 20);
  auto b = agent.acquire(5ull << 20, LeaseEnd::High);

  // The shipped configuration, with the test's target file, a 1 s scrape
  // interval and a private data directory.
  const fs::path dir = c.dir();
  fs::create_directories(dir / "targets");
  std::ofstream(dir / "targets" / "leasehold.json")
      << nlohmann::json::array({{{"targets", {"127.0.0.1:" + std::to_string(http)}},
                                 {"labels", {{"server", "test"}}}}})
             .dump();
  std::string config =
      read_file(fs::path(LEASEHOLD_SOURCE_DIR) / "deploy/prometheus/prometheus.yml");
  replace(config, "/etc/prometheus/leasehold-targets/*.json", (dir / "targets/*.json").string());
  replace(config, "scrape_interval: 15s", "scrape_interval: 1s");
  replace(config, "refresh_interval: 1m", "refresh_interval: 1s");
  replace(config, "scrape_timeout: 5s", "scrape_timeout: 1s");
  std::ofstream(dir / "prometheus.yml") << config;
  // The example target file parses as file discovery expects.
  auto example = nlohmann::json::parse(
      read_file(fs::path(LEASEHOLD_SOURCE_DIR) / "deploy/prometheus/leasehold-targets.json"));
  EXPECT_FALSE(example.at(0).at("targets").empty());

  const int web = free_port();
  Process prom({prometheus, "--config.file=" + (dir / "prometheus.yml").string(),
                "--storage.tsdb.path=" + (dir / "tsdb").string(),
                "--web.listen-address=127.0.0.1:" + std::to_string(web)},
               (dir / "prometheus.log").string());
  std::optional<nlohmann::json> sample;
  ASSERT_TRUE(eventually(
      [&] {
        if (!prom.running()) return true;
        sample = query(web, "leasehold_pool_used_bytes");
        return sample.has_value();
      },
      90s))
      << "no sample within 90 s:\n"
      << prom.log();
  ASSERT_TRUE(prom.running()) << prom.log();
  ASSERT_TRUE(sample);

  auto [rc, out] = c.run("leasehold", {"--endpoint", c.endpoint(), "status", "-o", "json"});
  ASSERT_EQ(rc, 0) << out;
  const auto status = nlohmann::json::parse(out);
  const auto used = status["devices"][0]["used_bytes"].get<uint64_t>();
  EXPECT_EQ(used, 8ull << 20);
  EXPECT_EQ(std::stoull(sample->at("value").at(1).get<std::string>()), used);
  EXPECT_EQ(sample->at("metric").at("gpu"), "0") << "the device's ordinal, as DCGM writes it";
  EXPECT_EQ(sample->at("metric").at("UUID"), "host-0");
  EXPECT_EQ(sample->at("metric").at("server"), "test") << "the file-discovery label";
  EXPECT_EQ(sample->at("metric").at("job"), "leasehold");
  // For the record (the note quotes it).
  std::cout << "prometheus " << prometheus
            << " answered leasehold_pool_used_bytes = " << sample->dump()
            << "\nleasehold status -o json: devices[0].used_bytes = " << used << "\n";
  auto up = query(web, "up{job=\"leasehold\"}");
  ASSERT_TRUE(up);
  EXPECT_EQ(up->at("value").at(1), "1");
}

}  // namespace
}  // namespace leasehold::testing
