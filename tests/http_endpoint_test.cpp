// The coordinator's HTTP endpoint (coordinator/http_endpoint.h), from
// outside: a real coordinator, requests with cpp-httplib's client.
#include "coordinator/http_endpoint.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "lease_client/session.h"
#include "tests/support/cluster.h"
#include "tests/support/net.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

TEST(HttpEndpoint, StatusAndMetricsMatchTheClient) {
  Cluster c;
  const int port = free_port();
  c.start_coordinator(
      {"--backend", "host", "--pool-size", "64MiB", "--http", "127.0.0.1:" + std::to_string(port)});
  c.start_agent("a1", {});
  ASSERT_TRUE(c.wait_for([](const nlohmann::json& s) { return s["agents"].size() == 1; }, 10s));
  // Published a few times a second; the agent is "warming" until it has
  // said it is ready, which on a busy machine can be after it registered.
  ASSERT_TRUE(eventually(
      [&] {
        auto s = http_get(port, "/api/status");
        if (!s) return false;
        auto agents = nlohmann::json::parse(*s)["agents"];
        return agents.size() == 1 && agents[0]["state"] == "idle";
      },
      10s));
  httplib::Client http("127.0.0.1", port);
  auto st = http.Get("/api/status");
  ASSERT_TRUE(st) << "no answer";
  EXPECT_EQ(st->status, 200);
  auto mine = nlohmann::json::parse(st->body);
  auto theirs = *c.status();
  EXPECT_EQ(mine["devices"], theirs["devices"]) << "one renderer for both";
  EXPECT_EQ(mine["agents"].size(), 1u);
  auto m = http.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_NE(m->body.find("leasehold_pool_size_bytes{gpu=\"0\",UUID=\"host-0\"} 67108864"),
            std::string::npos)
      << m->body;
  EXPECT_NE(m->body.find("leasehold_agents{gpu=\"0\",UUID=\"host-0\",state=\"idle\"} 1\n"),
            std::string::npos)
      << m->body;
}

TEST(HttpEndpoint, ATakenPortIsAStartUpErrorNamingIt) {
  Cluster c;
  const int port = free_port();
  c.start_coordinator(
      {"--backend", "host", "--pool-size", "64MiB", "--http", "127.0.0.1:" + std::to_string(port)});
  Cluster other;
  auto [rc, out] = other.run(
      "leasehold-coordinator",
      {"--endpoint", other.endpoint(), "--state-dir", other.state_dir(), "--backend", "host",
       "--pool-size", "64MiB", "--mps", "off", "--http", "127.0.0.1:" + std::to_string(port)});
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("cannot serve HTTP on 127.0.0.1:" + std::to_string(port)), std::string::npos)
      << out;
}

TEST(HttpEndpoint, ASilentClientDoesNotStallTheLoop) {
  Cluster c;
  const int port = free_port();
  c.start_coordinator(
      {"--backend", "host", "--pool-size", "64MiB", "--http", "127.0.0.1:" + std::to_string(port)});
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
  // They hold no thread, and are closed at the request deadline.
  EXPECT_TRUE(eventually([&] { return http_get(port, "/api/status", 2s).has_value(); }, 20s));
  for (int fd : fds) ::close(fd);
}

// A coordinator with its HTTP endpoint on a free port, and the synthetic
// dataset of the job tests.
class Http : public ::testing::Test {
 protected:
  void SetUp() override {
    write_synthetic_idx(c.dir(), "train", 600, 1);
    write_synthetic_idx(c.dir(), "test", 150, 2);
    c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--alignment", "1MiB",
                         "--heartbeat-interval", "200ms", "--http",
                         "127.0.0.1:" + std::to_string(port)});
  }
  std::string job_file(const std::string& name, const std::string& extra, int hidden = 16) {
    std::string path = c.dir() + "/" + name + ".json";
    std::ofstream(path) << synthetic_job_json(c.dir(), name, extra, hidden);
    return path;
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    args.insert(args.begin(), {"--endpoint", c.endpoint()});
    return c.run("leasehold", args);
  }
  std::string metrics() { return http_get(port, "/metrics").value_or(""); }
  AgentOptions agent(const std::string& name) {
    AgentOptions o;
    o.endpoint = c.endpoint();
    o.name = name;
    return o;
  }

  const int port = free_port();
  Cluster c;
};

TEST_F(Http, JobsAndEventsAreWhatTheClientShows) {
  // Follow /api/events from before the submission.
  std::mutex mu;
  std::vector<std::string> events;
  httplib::Client stream("127.0.0.1", port);
  stream.set_read_timeout(60, 0);
  std::atomic<bool> attached{false};
  std::thread reader([&] {
    stream.Get("/api/events", [&](const char* data, size_t n) {
      std::lock_guard lock(mu);
      events.emplace_back(data, n);
      attached = true;  // the stream's opening comment
      return true;
    });
  });
  ASSERT_TRUE(eventually([&] { return attached.load(); }, 10s));
  c.start_agent("a1", {});
  auto [rc, out] = client({"submit", job_file("small", R"(, "epochs": 2)"), "--follow"});
  ASSERT_EQ(rc, 0) << out;

  // /api/jobs and /api/jobs/1 become what `leasehold jobs/job -o json` print.
  auto [rc1, list] = client({"jobs", "-o", "json"});
  ASSERT_EQ(rc1, 0) << list;
  EXPECT_TRUE(eventually(
      [&] {
        auto mine = http_get(port, "/api/jobs");
        return mine && nlohmann::json::parse(*mine) == nlohmann::json::parse(list);
      },
      5s))
      << http_get(port, "/api/jobs").value_or("no answer") << "\n---\n"
      << list;
  auto [rc2, one] = client({"job", "1", "-o", "json"});
  ASSERT_EQ(rc2, 0) << one;
  auto mine = nlohmann::json::parse(http_get(port, "/api/jobs/1").value_or("null"));
  EXPECT_EQ(mine, nlohmann::json::parse(one));
  EXPECT_EQ(mine["state"], "succeeded");
  EXPECT_EQ(mine["epochs"].size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(*http_get(port, "/api/jobs?after=1")).size(), 0u);
  EXPECT_EQ(nlohmann::json::parse(*http_get(port, "/api/jobs?newest=5")),
            nlohmann::json::parse(list));

  // The stream carried the job's changes as they happened, up to its end.
  EXPECT_TRUE(eventually(
      [&] {
        std::lock_guard lock(mu);
        std::string all;
        for (auto& e : events) all += e;
        return all.find("\"state\":\"succeeded\"") != std::string::npos;
      },
      5s));
  stream.stop();
  reader.join();
  std::string all;
  for (auto& e : events) all += e;
  EXPECT_NE(all.find("data: {\"job\":{"), std::string::npos) << all.substr(0, 2000);
  EXPECT_NE(all.find("\"topic\":\"job.1.\""), std::string::npos);
  EXPECT_NE(all.find("\"state\":\"running\""), std::string::npos);
}

TEST_F(Http, MetricsCountLeaseOutcomesAndShowRunningJobs) {
  {
    AgentSession s(agent("leaser"));
    AgentSession other(agent("waiter"));
    auto held = s.acquire(40ull << 20);          // of 64 MiB
    EXPECT_THROW(s.acquire(1ull << 30), Error);  // can never fit
    // Waits for the first agent's memory, then times out.
    EXPECT_THROW(other.acquire(40ull << 20, LeaseEnd::Low, 300ms), Error);
    ASSERT_TRUE(eventually(
        [&] {
          auto m = metrics();
          return m.find("leasehold_lease_grants_total{gpu=\"0\",UUID=\"host-0\"} 1\n") !=
                     std::string::npos &&
                 m.find("leasehold_lease_refusals_total{gpu=\"0\",UUID=\"host-0\"} 1\n") !=
                     std::string::npos &&
                 m.find("leasehold_lease_timeouts_total{gpu=\"0\",UUID=\"host-0\"} 1\n") !=
                     std::string::npos &&
                 m.find("leasehold_pool_used_bytes{gpu=\"0\",UUID=\"host-0\"} 41943040\n") !=
                     std::string::npos &&
                 m.find("leasehold_agents{gpu=\"0\",UUID=\"host-0\",state=\"leasing\"} 1\n") !=
                     std::string::npos;
        },
        5s))
        << metrics();
    EXPECT_NE(metrics().find("leasehold_lease_grant_latency_seconds_bucket{gpu=\"0\",UUID="
                             "\"host-0\",le=\"0.001\"} 1\n"),
              std::string::npos)
        << metrics();
  }
  // A long job: its series appear, labelled with its id, name, agent and
  // the user who submitted it.
  c.start_agent("trainer", {});
  auto [rc, out] = client({"submit", job_file("long", R"(, "epochs": 400)", 256)});
  ASSERT_EQ(rc, 0) << out;
  const passwd* me = ::getpwuid(::getuid());
  ASSERT_NE(me, nullptr);
  const std::string labels =
      "{gpu=\"0\",UUID=\"host-0\",job_id=\"1\",name=\"long\",agent=\"trainer\"," +
      std::string("user=\"") + me->pw_name + "\"}";
  EXPECT_TRUE(eventually(
      [&] {
        auto m = metrics();
        return m.find("leasehold_job_samples_per_second" + labels) != std::string::npos &&
               m.find("leasehold_job_loss" + labels) != std::string::npos &&
               m.find("leasehold_job_test_accuracy_ratio" + labels) != std::string::npos &&
               m.find("leasehold_job_leased_bytes" + labels) != std::string::npos &&
               m.find("leasehold_jobs{state=\"running\"} 1\n") != std::string::npos;
      },
      30s))
      << metrics();
  ASSERT_EQ(client({"cancel", "1"}).first, 0);
  EXPECT_TRUE(eventually(
      [&] {
        auto m = metrics();
        return m.find("leasehold_job_loss{") == std::string::npos &&
               m.find("leasehold_jobs{state=\"cancelled\"} 1\n") !=
                   std::string::npos;
      },
      10s))
      << "a finished job's series go: " << metrics();
}

TEST_F(Http, IsReadOnlyAndNamesBadRequests) {
  httplib::Client h("127.0.0.1", port);
  auto post = h.Post("/api/jobs", "{}", "application/json");
  ASSERT_TRUE(post);
  EXPECT_EQ(post->status, 405);
  EXPECT_NE(post->body.find("read-only"), std::string::npos) << post->body;
  auto del = h.Delete("/api/jobs/1");
  ASSERT_TRUE(del);
  EXPECT_EQ(del->status, 405);
  auto bad = h.Get("/api/jobs/abc");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 400);
  EXPECT_NE(bad->body.find("'abc' is not a job id"), std::string::npos) << bad->body;
  auto none = h.Get("/api/jobs/42");
  ASSERT_TRUE(none);
  EXPECT_EQ(none->status, 404);
  EXPECT_NE(none->body.find("no job with id 42"), std::string::npos) << none->body;
  auto limit = h.Get("/api/jobs?limit=ten");
  ASSERT_TRUE(limit);
  EXPECT_EQ(limit->status, 400);
  EXPECT_NE(limit->body.find("'limit'"), std::string::npos) << limit->body;
  // A request with a body is refused before the body is read.
  auto big = h.Post("/api/jobs", std::string(1 << 20, 'x'), "application/json");
  ASSERT_TRUE(big);
  EXPECT_EQ(big->status, 413);
  // A page elsewhere reaching the loopback endpoint by DNS rebinding names
  // its own host: refused.
  auto rebound = h.Get("/api/status", httplib::Headers{{"Host", "evil.example:9464"}});
  ASSERT_TRUE(rebound);
  EXPECT_EQ(rebound->status, 403);
  EXPECT_NE(rebound->body.find("evil.example"), std::string::npos) << rebound->body;
  auto page = h.Get("/no-such-page");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 404);
  // Nothing changed, and the coordinator answers.
  auto status = c.status();
  ASSERT_TRUE(status);
  EXPECT_EQ((*status)["devices"][0]["used_bytes"], 0);
  EXPECT_EQ(client({"jobs", "-o", "json"}).second, "[]\n");
}

TEST_F(Http, ServesTheDashboardFromTheBinary) {
  httplib::Client h("127.0.0.1", port);
  auto page = h.Get("/");
  ASSERT_TRUE(page);
  EXPECT_EQ(page->status, 200);
  EXPECT_EQ(page->get_header_value("Content-Type"), "text/html; charset=utf-8");
  EXPECT_NE(page->body.find("<script src=\"/dashboard.js\">"), std::string::npos);
  for (const char* path : {"/dashboard.js", "/dashboard.css"}) {
    auto f = h.Get(path);
    ASSERT_TRUE(f) << path;
    EXPECT_EQ(f->status, 200) << path;
    EXPECT_GT(f->body.size(), 1000u) << path;
  }
  auto history = nlohmann::json::parse(http_get(port, "/api/history").value_or("{}"));
  EXPECT_EQ(history["columns"], (nlohmann::json{"unix_ms", "occupancy", "used_bytes"}));
  EXPECT_GE(history["samples"].size(), 1u);
}

TEST_F(Http, EventStreamsAreCappedAndTheRestStillAnswers) {
  // Streams that never read: the fifth is refused, /api/status still answers.
  std::vector<std::unique_ptr<httplib::Client>> streams;
  std::vector<std::thread> readers;
  std::atomic<int> opened{0};
  for (int i = 0; i < HttpEndpoint::kMaxStreams; ++i) {
    streams.push_back(std::make_unique<httplib::Client>("127.0.0.1", port));
    streams.back()->set_read_timeout(60, 0);
    readers.emplace_back([&, h = streams.back().get()] {
      h->Get("/api/events", [&](const char*, size_t) {
        ++opened;
        return true;
      });
    });
  }
  ASSERT_TRUE(eventually([&] { return opened.load() == HttpEndpoint::kMaxStreams; }, 10s));
  httplib::Client h("127.0.0.1", port);
  auto extra = h.Get("/api/events");
  ASSERT_TRUE(extra);
  EXPECT_EQ(extra->status, 503);
  EXPECT_NE(extra->body.find("too many event streams"), std::string::npos) << extra->body;
  EXPECT_TRUE(http_get(port, "/api/status"));
  EXPECT_TRUE(c.status());
  for (auto& h : streams) h->stop();
  for (auto& t : readers) t.join();
  // Their places are free again.
  EXPECT_TRUE(eventually(
      [&] {
        httplib::Client again("127.0.0.1", port);
        again.set_read_timeout(1, 0);
        bool ok = false;
        again.Get(
            "/api/events",
            [&](const httplib::Response& r) {
              ok = r.status == 200;
              return false;
            },
            [](const char*, size_t) { return false; });
        return ok;
      },
      10s));
}

}  // namespace
}  // namespace leasehold::testing
