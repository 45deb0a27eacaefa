// The coordinator's HTTP endpoint (coordinator/http_endpoint.h), from
// outside: a real coordinator, requests with cpp-httplib's client.
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "tests/support/cluster.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

// A free loopback port (bound, read, released).
int free_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

TEST(HttpEndpoint, StatusAndMetricsMatchTheClient) {
  Cluster c;
  const int port = free_port();
  c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--http",
                       "127.0.0.1:" + std::to_string(port)});
  c.start_agent("a1", {});
  ASSERT_TRUE(c.wait_for([](const nlohmann::json& s) { return s["agents"].size() == 1; }, 10s));
  std::this_thread::sleep_for(500ms);  // two publications later
  httplib::Client http("127.0.0.1", port);
  auto st = http.Get("/api/status");
  ASSERT_TRUE(st) << "no answer";
  EXPECT_EQ(st->status, 200);
  auto mine = nlohmann::json::parse(st->body);
  auto theirs = *c.status();
  EXPECT_EQ(mine["pool"], theirs["pool"]) << "one renderer for both";
  EXPECT_EQ(mine["agents"].size(), 1u);
  auto m = http.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("leasehold_pool_size_bytes{UUID=\"\",gpu=\"host\"} 67108864"),
            std::string::npos)
      << m->body;
  EXPECT_NE(m->body.find("leasehold_agents{UUID=\"\",gpu=\"host\",state="), std::string::npos)
      << m->body;
}

TEST(HttpEndpoint, ATakenPortIsAStartUpErrorNamingIt) {
  Cluster c;
  const int port = free_port();
  c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--http",
                       "127.0.0.1:" + std::to_string(port)});
  Cluster other;
  auto [rc, out] = other.run("leasehold-coordinator",
                             {"--endpoint", other.endpoint(), "--state-dir", other.state_dir(),
                              "--backend", "host", "--pool-size", "64MiB", "--mps", "off",
                              "--http", "127.0.0.1:" + std::to_string(port)});
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("cannot serve HTTP on 127.0.0.1:" + std::to_string(port)), std::string::npos)
      << out;
}

TEST(HttpEndpoint, ASilentClientDoesNotStallTheLoop) {
  Cluster c;
  const int port = free_port();
  c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--http",
                       "127.0.0.1:" + std::to_string(port)});
  // Connections that send half a request and wait.
  std::vector<int> fds;
  for (int i = 0; i < 16; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(uint16_t(port));
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    const char half[] = "GET /api/sta";
    ASSERT_GT(::write(fd, half, sizeof half - 1), 0);
    fds.push_back(fd);
  }
  for (int i = 0; i < 5; ++i) {
    EXPECT_TRUE(c.status(2s)) << "the coordinator stopped answering";
    std::this_thread::sleep_for(200ms);
  }
  for (int fd : fds) ::close(fd);
}

}  // namespace
}  // namespace leasehold::testing
