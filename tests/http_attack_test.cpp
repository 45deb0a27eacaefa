// The HTTP endpoint (coordinator/http_endpoint.h) under attack by a local
// user, over real sockets: bodies and header floods cost no memory, slow
// clients hold nothing past the request deadline, one address cannot take
// every connection, and only requests naming this loopback endpoint exactly
// are served. After each attack the endpoint still answers correctly.
#include <arpa/inet.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/http_endpoint.h"
#include "tests/support/cluster.h"
#include "tests/support/net.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// What /api/status serves in the tests that run an endpoint in-process.
constexpr const char* kStatus = R"({"devices":[{"used_bytes":0}]})";

// A client connection to the endpoint; closed by the destructor.
class Socket {
 public:
  // To 127.0.0.1:PORT from `source` (another loopback address) when given,
  // or to [::1]:PORT.
  explicit Socket(int port, const std::string& source = "", bool v6 = false) {
    fd_ = ::socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) return;
    int rc = -1;
    if (v6) {
      sockaddr_in6 a{};
      a.sin6_family = AF_INET6;
      a.sin6_addr = in6addr_loopback;
      a.sin6_port = htons(static_cast<uint16_t>(port));
      rc = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    } else {
      if (!source.empty()) {
        sockaddr_in from{};
        from.sin_family = AF_INET;
        if (::inet_pton(AF_INET, source.c_str(), &from.sin_addr) != 1 ||
            ::bind(fd_, reinterpret_cast<sockaddr*>(&from), sizeof from) != 0) {
          reset();
          return;
        }
      }
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(port));
      rc = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a);
    }
    if (rc != 0) reset();
  }
  ~Socket() { reset(); }
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  bool ok() const { return fd_ >= 0; }

  // Sends all of `data`; false once the server closed or reset the
  // connection (MSG_NOSIGNAL: no SIGPIPE).
  bool send(std::string_view data) {
    while (!data.empty()) {
      const ssize_t n = ::send(fd_, data.data(), data.size(), MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) return false;
      data.remove_prefix(static_cast<size_t>(n));
    }
    return true;
  }

  // What arrives until the server closes, `timeout` passes, or (when not
  // empty) `until` has been seen.
  std::string read(std::chrono::milliseconds timeout, std::string_view until = {}) {
    std::string got;
    const auto deadline = Clock::now() + timeout;
    closed_ = false;
    while (true) {
      if (!until.empty() && got.find(until) != std::string::npos) return got;
      // Past the deadline, one last look at what has arrived already.
      const auto left = std::max<std::chrono::milliseconds::rep>(
          0,
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count());
      pollfd p{fd_, POLLIN, 0};
      const int ready = ::poll(&p, 1, static_cast<int>(left));
      if (ready < 0 && errno == EINTR) continue;
      if (ready <= 0) return got;
      char buf[16384];
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        closed_ = true;
        return got;
      }
      got.append(buf, static_cast<size_t>(n));
    }
  }
  // Whether the last read() ended because the server closed.
  bool closed() const { return closed_; }

 private:
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd_ = -1;
  bool closed_ = false;
};

struct Answer {
  int status = 0;
  std::string head, body;
};

// An answer's status line, headers and body (what follows the headers).
Answer parse_answer(const std::string& raw) {
  Answer a;
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || raw.size() < 12) return a;
  a.status = std::stoi(raw.substr(9, 3));
  const auto end = raw.find("\r\n\r\n");
  a.head = raw.substr(0, end);
  if (end != std::string::npos) a.body = raw.substr(end + 4);
  return a;
}

std::string get(const std::string& path, const std::string& host, const std::string& extra = "") {
  return "GET " + path + " HTTP/1.1\r\nHost: " + host + "\r\nConnection: close\r\n" + extra +
         "\r\n";
}

// Sends `request` on a new connection, reads until the server closes.
Answer ask(int port, const std::string& request, const std::string& source = "", bool v6 = false,
           std::chrono::milliseconds timeout = 5s) {
  Socket s(port, source, v6);
  if (!s.ok() || !s.send(request)) return {};
  return parse_answer(s.read(timeout));
}

// /api/status on a fresh connection: 200 with the published text, within
// `timeout`.
bool status_answers(int port, const std::string& expected = kStatus,
                    std::chrono::milliseconds timeout = 5s) {
  const Answer a =
      ask(port, get("/api/status", "127.0.0.1:" + std::to_string(port)), "", false, timeout);
  return a.status == 200 && (expected.empty() || a.body == expected);
}

uint64_t rss_kib(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6));
  }
  return 0;
}

size_t entries(const std::string& dir) {
  size_t n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] != '.') ++n;
    }
    ::closedir(d);
  }
  return n;
}

// Asks for /api/status every 200 ms while an attack runs; records the
// slowest answer, the failures and the largest RSS of `pid`.
class Prober {
 public:
  Prober(int port, pid_t pid, std::string expected)
      : port_(port), pid_(pid), expected_(std::move(expected)), thread_([this] { run(); }) {}
  ~Prober() { stop(); }
  void stop() {
    stop_ = true;
    if (thread_.joinable()) thread_.join();
  }
  std::chrono::milliseconds slowest() const { return slowest_; }
  int failures() const { return failures_; }
  int probes() const { return probes_; }
  uint64_t peak_rss_kib() const { return peak_rss_; }

 private:
  void run() {
    while (!stop_) {
      const auto t0 = Clock::now();
      const bool ok = status_answers(port_, expected_, 5s);
      const auto took = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - t0);
      slowest_ = std::max(slowest_, took);
      ++probes_;
      if (!ok) ++failures_;
      peak_rss_ = std::max(peak_rss_, rss_kib(pid_));
      std::this_thread::sleep_for(200ms);
    }
  }
  const int port_;
  const pid_t pid_;
  const std::string expected_;
  std::atomic<bool> stop_{false};
  std::chrono::milliseconds slowest_{0};
  int failures_ = 0, probes_ = 0;
  uint64_t peak_rss_ = 0;
  std::thread thread_;
};

// A coordinator with its HTTP endpoint, for the attacks measured by its RSS.
class HttpAttack : public ::testing::Test {
 protected:
  void SetUp() override {
#if defined(__SANITIZE_ADDRESS__)
    // ASan keeps freed memory in a quarantine (256 MiB by default), which
    // the coordinator's RSS would show as growth: a small one for it.
    const char* options = std::getenv("ASAN_OPTIONS");
    std::string mine = options && *options ? std::string(options) + ":" : std::string();
    ASSERT_EQ(::setenv("ASAN_OPTIONS", (mine + "quarantine_size_mb=16").c_str(), 1), 0);
#endif
    coordinator = &c.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--http",
                                        "127.0.0.1:" + std::to_string(port)});
    ASSERT_TRUE(eventually([&] { return status_answers(port, ""); }, 10s));
  }
  // Runs `attack` on `threads` threads for `duration` while a Prober asks
  // for /api/status; asserts the coordinator's RSS grew by less than 64 MiB
  // and every probe was answered within 5 s.
  void under_attack(int threads, std::chrono::seconds duration,
                    const std::function<void(std::atomic<bool>& stop)>& attack) {
    const uint64_t before = rss_kib(coordinator->pid());
    ASSERT_GT(before, 0u);
    std::atomic<bool> stop{false};
    Prober prober(port, coordinator->pid(), "");
    std::vector<std::thread> attackers;
    for (int i = 0; i < threads; ++i) attackers.emplace_back([&] { attack(stop); });
    std::this_thread::sleep_for(duration);
    stop = true;
    for (auto& t : attackers) t.join();
    prober.stop();
    const uint64_t after = rss_kib(coordinator->pid());
    EXPECT_LT(prober.peak_rss_kib(), before + 64 * 1024)
        << "RSS before " << before << " KiB, peak " << prober.peak_rss_kib() << " KiB";
    EXPECT_LT(after, before + 64 * 1024) << "RSS before " << before << " KiB, after " << after;
    EXPECT_GE(prober.probes(), 3);
    EXPECT_EQ(prober.failures(), 0) << "of " << prober.probes() << " probes";
    EXPECT_LT(prober.slowest(), 5s);
    EXPECT_TRUE(status_answers(port, "")) << "the endpoint still serves";
    EXPECT_TRUE(c.status()) << "and the coordinator answers";
  }

  const int port = free_port();
  Cluster c;
  Process* coordinator = nullptr;
};

TEST_F(HttpAttack, ChunkedBodiesAreRefusedUnreadAndMemoryStaysFlat) {
  // Each attacker offers 256 MiB, chunk by chunk, again and again; the
  // server answers 413 on the head and stops reading.
  std::mutex mu;
  std::vector<std::string> problems;
  std::atomic<int> refused{0};
  const std::string chunk = "100000\r\n" + std::string(1 << 20, 'x') + "\r\n";
  under_attack(4, 4s, [&](std::atomic<bool>& stop) {
    while (!stop) {
      Socket s(port);
      if (!s.send("POST /api/jobs HTTP/1.1\r\nHost: 127.0.0.1:" + std::to_string(port) +
                  "\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk)) {
        continue;
      }
      const Answer a = parse_answer(s.read(5s, "}"));
      size_t mib = 1;
      while (mib < 256 && s.send(chunk)) ++mib;
      std::lock_guard lock(mu);
      if (a.status != 413 || a.body.find("request bodies are not accepted: this endpoint is "
                                         "read-only") == std::string::npos) {
        problems.push_back("answer: " + a.head + a.body);
      } else if (mib >= 64) {
        problems.push_back("the server read " + std::to_string(mib) + " MiB of a refused body");
      } else {
        ++refused;
      }
    }
  });
  EXPECT_GT(refused.load(), 4);
  EXPECT_TRUE(problems.empty()) << problems.front();
}

TEST_F(HttpAttack, HeaderFloodsAreRefusedAndMemoryStaysFlat) {
  // Two million header lines offered on each connection; and requests of
  // many short lines, under the byte limit but over the count.
  std::mutex mu;
  std::vector<std::string> problems;
  std::atomic<int> refused{0};
  const std::string lines = [] {
    std::string out;
    for (int i = 0; i < 10000; ++i) out += "X-a: b\r\n";
    return out;
  }();
  const std::string host = "Host: 127.0.0.1:" + std::to_string(port) + "\r\n";
  under_attack(4, 4s, [&](std::atomic<bool>& stop) {
    for (int round = 0; !stop; ++round) {
      Socket s(port);
      if (round % 2) {
        std::string few = "GET /api/status HTTP/1.1\r\n" + host;
        for (int i = 0; i < HttpEndpoint::kMaxHeaderFields + 50; ++i) few += "a:b\r\n";
        const Answer a = s.send(few + "\r\n") ? parse_answer(s.read(5s, "}")) : Answer{};
        std::lock_guard lock(mu);
        if (a.status != 431 ||
            a.body.find("more than 100 request header lines") == std::string::npos) {
          problems.push_back("many lines: " + a.head + a.body);
        }
        continue;
      }
      if (!s.send("GET /api/status HTTP/1.1\r\n" + host + lines)) continue;
      const Answer a = parse_answer(s.read(5s, "}"));
      size_t sent = 1;
      while (sent < 200 && s.send(lines)) ++sent;  // 2M lines in all
      std::lock_guard lock(mu);
      if (a.status != 431 || a.body.find("request headers over 16 KiB") == std::string::npos) {
        problems.push_back("answer: " + a.head + a.body);
      } else if (sent >= 200) {
        problems.push_back("the server read 2M header lines");
      } else {
        ++refused;
      }
    }
  });
  EXPECT_GT(refused.load(), 4);
  EXPECT_TRUE(problems.empty()) << problems.front();
}

// An endpoint in this process with a status published.
std::unique_ptr<HttpEndpoint> endpoint(const std::string& listen = "127.0.0.1:0") {
  auto e = std::make_unique<HttpEndpoint>(listen);
  e->publish_status(kStatus, MetricsSnapshot{});
  return e;
}

TEST(HttpLimits, SlowClientsAreClosedAtTheDeadlineWhileStatusAnswers) {
  auto ep = endpoint();
  const int port = ep->port();
  const std::string host = "127.0.0.1:" + std::to_string(port);
  // Every event stream there may be, reading nothing...
  std::vector<std::unique_ptr<Socket>> streams;
  for (int i = 0; i < HttpEndpoint::kMaxStreams; ++i) {
    streams.push_back(std::make_unique<Socket>(port));
    ASSERT_TRUE(streams.back()->send(get("/api/events", host)));
    ASSERT_NE(streams.back()->read(5s, "leasehold events").find(": leasehold events"),
              std::string::npos);
  }
  // ...and twice as many slow clients as the old server had threads, each
  // sending its request a byte a second.
  constexpr int kSlow = 16;
  const std::string request = get("/api/status", host) + std::string(100, ' ');
  std::vector<std::unique_ptr<Socket>> slow;
  const auto t0 = Clock::now();
  for (int i = 0; i < kSlow; ++i) slow.push_back(std::make_unique<Socket>(port));
  std::vector<std::optional<Clock::duration>> ended(kSlow);
  std::vector<std::string> answers(kSlow);
  std::chrono::milliseconds slowest{0};
  for (size_t byte = 0; Clock::now() - t0 < HttpEndpoint::kRequestDeadline + 15s; ++byte) {
    for (int i = 0; i < kSlow; ++i) {
      if (ended[i]) continue;
      // A byte, then whatever the server said: an answer and its close.
      if (!slow[i]->send(request.substr(byte % request.size(), 1))) {
        ended[i] = Clock::now() - t0;
        continue;
      }
      answers[i] += slow[i]->read(1ms);
      if (slow[i]->closed()) ended[i] = Clock::now() - t0;
    }
    if (std::all_of(ended.begin(), ended.end(), [](auto& e) { return e.has_value(); })) break;
    const auto p0 = Clock::now();
    EXPECT_TRUE(status_answers(port)) << "at byte " << byte;
    slowest =
        std::max(slowest, std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - p0));
    std::this_thread::sleep_for(1s - (Clock::now() - p0));
  }
  EXPECT_LT(slowest, 5s);
  for (int i = 0; i < kSlow; ++i) {
    ASSERT_TRUE(ended[i]) << "slow client " << i << " still open";
    EXPECT_GE(*ended[i], HttpEndpoint::kRequestDeadline - 1s) << i;
    EXPECT_LE(*ended[i], HttpEndpoint::kRequestDeadline + 10s) << i;
    const Answer a = parse_answer(answers[i]);
    EXPECT_EQ(a.status, 408) << answers[i];
    EXPECT_NE(a.body.find("request not received whole within 10 s"), std::string::npos) << a.body;
  }
  // The streams outlive the deadline and still carry events.
  ep->publish_event(R"({"topic":"test."})");
  for (auto& s : streams) {
    EXPECT_NE(s->read(5s, "test.").find("data: {\"topic\":\"test.\"}"), std::string::npos);
  }
  EXPECT_TRUE(status_answers(port));
}

TEST(HttpLimits, ConnectionsPerAddressAreBounded) {
  auto ep = endpoint();
  const int port = ep->port();
  const std::string host = "127.0.0.1:" + std::to_string(port);
  // Idle connections from 127.0.0.1 up to the bound...
  std::vector<std::unique_ptr<Socket>> held;
  for (int i = 0; i < HttpEndpoint::kMaxConnectionsPerAddress; ++i) {
    held.push_back(std::make_unique<Socket>(port));
    ASSERT_TRUE(held.back()->ok());
  }
  // ...the next one from there is refused at once, unread...
  const auto t0 = Clock::now();
  const Answer extra = ask(port, get("/api/status", host));
  EXPECT_EQ(extra.status, 503) << extra.head;
  EXPECT_NE(extra.body.find("too many connections from 127.0.0.1 (at most 32 at once)"),
            std::string::npos)
      << extra.body;
  EXPECT_LT(Clock::now() - t0, 5s);
  // ...and so are a hundred more at once (answered 503 or closed, never
  // served), while another address is served.
  std::vector<std::unique_ptr<Socket>> excess;
  for (int i = 0; i < 100; ++i) {
    excess.push_back(std::make_unique<Socket>(port));
    ASSERT_TRUE(excess.back()->ok());
    excess.back()->send(get("/api/status", host));
  }
  for (auto& s : excess) {
    const std::string got = s->read(10s);
    EXPECT_TRUE(s->closed()) << "an excess connection left open";
    EXPECT_TRUE(got.empty() || parse_answer(got).status == 503) << got;
  }
  excess.clear();
  const Answer other = ask(port, get("/api/status", host), "127.0.0.2");
  EXPECT_EQ(other.status, 200) << other.head << other.body;
  EXPECT_EQ(other.body, kStatus);
  // The held ones give their places back as they close.
  held.clear();
  EXPECT_TRUE(eventually([&] { return status_answers(port); }, 10s));
}

TEST(HttpLimits, TheHostHeaderMustNameThisLoopbackEndpointExactly) {
  auto ep = endpoint();
  const int port = ep->port();
  const std::string p = std::to_string(port);
  struct Case {
    std::string host_lines;  // the request's Host header lines
    int status;
    std::string says;  // in the error's text
  };
  const std::vector<Case> refused = {
      {"Host: 127.0.0.1.evil.example\r\n", 403, "not this loopback endpoint"},
      {"Host: 127.0.0.1.evil.example:" + p + "\r\n", 403, "127.0.0.1.evil.example"},
      {"Host: 127.evil.example\r\n", 403, "not this loopback endpoint"},
      {"Host: localhost.evil\r\n", 403, "not this loopback endpoint"},
      {"Host: evil.example:" + p + "\r\n", 403, "evil.example"},
      {"Host: 127.0.0.1:80@evil.example\r\n", 400, "not a host name or address"},
      {"Host: 127.0.0.1:" + p + "/x\r\n", 400, "not a host name or address"},
      {"Host: 127.1\r\n", 400, "not a host name or address"},
      {"Host: 127.0.0.1:99999\r\n", 400, "not a host name or address"},
      {"Host: [::1\r\n", 400, "not a host name or address"},
      {"Host: [::ffff:127.0.0.1]\r\n", 403, "not this loopback endpoint"},
      {"Host: user@localhost\r\n", 400, "not a host name or address"},
      {"Host:\r\n", 400, "not a host name or address"},
      {"Host: \r\n", 400, "not a host name or address"},
      {"", 400, "no Host header"},
      {"Host: 127.0.0.1:" + p + "\r\nHost: 127.0.0.1:" + p + "\r\n", 400, "more than one Host"},
      {"Host: 127.0.0.1:" + p + "\r\nHost: evil.example\r\n", 400, "more than one Host"},
  };
  for (const auto& c : refused) {
    const Answer a =
        ask(port, "GET /api/status HTTP/1.1\r\n" + c.host_lines + "Connection: close\r\n\r\n");
    EXPECT_EQ(a.status, c.status) << c.host_lines << a.head;
    EXPECT_NE(a.body.find(c.says), std::string::npos) << c.host_lines << a.body;
    EXPECT_EQ(a.body.find(kStatus), std::string::npos) << c.host_lines;
    EXPECT_EQ(a.body.rfind("{\"error\":", 0), 0u) << a.body;
  }
  for (const std::string& host : std::vector<std::string>{
           "127.0.0.1:" + p, "localhost:" + p, "LocalHost:" + p, "[::1]:" + p, "127.0.0.1",
           "localhost", "[::1]", "127.0.0.2:" + p, "[0:0:0:0:0:0:0:1]:" + p}) {
    const Answer a = ask(port, get("/api/status", host));
    EXPECT_EQ(a.status, 200) << host << " " << a.head << a.body;
    EXPECT_EQ(a.body, kStatus) << host;
  }
  EXPECT_TRUE(status_answers(port));
}

TEST(HttpLimits, AnIpv6LoopbackEndpointServesLoopbackNamesOnly) {
  std::unique_ptr<HttpEndpoint> v6;
  try {
    v6 = endpoint("[::1]:0");
  } catch (const std::runtime_error& e) {
    GTEST_SKIP() << "no IPv6 loopback here: " << e.what();
  }
  const std::string p6 = std::to_string(v6->port());
  for (const std::string& host :
       std::vector<std::string>{"[::1]:" + p6, "localhost:" + p6, "127.0.0.1:" + p6}) {
    const Answer a = ask(v6->port(), get("/api/status", host), "", true);
    EXPECT_EQ(a.status, 200) << host << " " << a.head;
    EXPECT_EQ(a.body, kStatus);
  }
  for (const std::string& host :
       std::vector<std::string>{"[::1].evil.example", "evil.example:" + p6, "[::1]:" + p6 + "@e"}) {
    const Answer a = ask(v6->port(), get("/api/status", host), "", true);
    EXPECT_TRUE(a.status == 403 || a.status == 400) << host << " " << a.head;
  }
}

TEST(HttpLimits, AnyWellFormedHostIsServedOffLoopback) {
  std::unique_ptr<HttpEndpoint> ep;
  try {
    ep = endpoint("0.0.0.0:0");
  } catch (const std::runtime_error& e) {
    GTEST_SKIP() << e.what();
  }
  const int port = ep->port();
  for (const std::string& host : std::vector<std::string>{
           "coordinator.example:" + std::to_string(port), "10.1.2.3", "[fe80::1]"}) {
    const Answer a = ask(port, get("/api/status", host));
    EXPECT_EQ(a.status, 200) << host << " " << a.head;
  }
  EXPECT_EQ(ask(port, get("/api/status", "a:80@b")).status, 400);
  EXPECT_EQ(ask(port, "GET /api/status HTTP/1.1\r\nConnection: close\r\n\r\n").status, 400);
}

TEST(HttpLimits, BodiesAreNeverReadAndTheConnectionCloses) {
  auto ep = endpoint();
  const int port = ep->port();
  const std::string host = "Host: 127.0.0.1:" + std::to_string(port) + "\r\n";
  struct Case {
    std::string head;
    int status;
    std::string says;
  };
  const std::vector<Case> cases = {
      {"GET /api/status HTTP/1.1\r\n" + host + "Content-Length: 5\r\n", 413,
       "request bodies are not accepted: this endpoint is read-only"},
      {"GET /api/status HTTP/1.1\r\n" + host + "Transfer-Encoding: chunked\r\n", 413,
       "request bodies are not accepted"},
      {"GET /api/status HTTP/1.1\r\n" + host + "Transfer-Encoding: gzip\r\n", 413,
       "request bodies are not accepted"},
      {"POST /api/jobs HTTP/1.1\r\n" + host + "Content-Length: 100000000\r\n", 413,
       "request bodies are not accepted"},
      {"POST /api/jobs HTTP/1.1\r\n" + host + "Content-Length: 2\r\n", 405,
       "POST is not served: the HTTP endpoint is read-only"},
      {"GET /api/status HTTP/1.1\r\n" + host + "Content-Length: 1\r\nContent-Length: 2\r\n", 400,
       "malformed request"},
      {"GET /api/status HTTP/1.1\r\n" + host +
           "Transfer-Encoding: chunked\r\nContent-Length: 2\r\n",
       400, "malformed request"},
  };
  for (const auto& c : cases) {
    Socket s(port);
    // The head, then a body that never ends: the answer comes on the head,
    // and the connection is closed without the body being waited for.
    ASSERT_TRUE(s.send(c.head + "\r\n" + std::string(1000, 'x')));
    const std::string got = s.read(5s);
    EXPECT_TRUE(s.closed()) << c.head;
    const Answer a = parse_answer(got);
    EXPECT_EQ(a.status, c.status) << c.head << got;
    EXPECT_NE(a.body.find(c.says), std::string::npos) << c.head << a.body;
    EXPECT_NE(a.head.find("Connection: close"), std::string::npos) << a.head;
  }
  EXPECT_TRUE(status_answers(port));
}

TEST(HttpLimits, KeptAliveConnectionsServeRequestAfterRequest) {
  auto ep = endpoint();
  const int port = ep->port();
  const std::string host = "Host: 127.0.0.1:" + std::to_string(port) + "\r\n";
  Socket s(port);
  // Two pipelined, one after the answers, then HEAD.
  ASSERT_TRUE(s.send("GET /api/status HTTP/1.1\r\n" + host + "\r\nGET /api/history HTTP/1.1\r\n" +
                     host + "\r\n"));
  std::string got = s.read(5s, "\"samples\"");
  EXPECT_NE(got.find(kStatus), std::string::npos) << got;
  EXPECT_NE(got.find("\"columns\""), std::string::npos) << got;
  ASSERT_TRUE(s.send("HEAD /metrics HTTP/1.1\r\n" + host + "Connection: close\r\n\r\n"));
  got = s.read(5s);
  EXPECT_TRUE(s.closed());
  const Answer a = parse_answer(got);
  EXPECT_EQ(a.status, 200) << got;
  EXPECT_NE(a.head.find("Content-Length: "), std::string::npos);
  EXPECT_TRUE(a.body.empty()) << "HEAD has no body";
  // An idle kept-alive connection is closed silently at the deadline.
  Socket idle(port);
  ASSERT_TRUE(idle.send("GET /api/status HTTP/1.1\r\n" + host + "\r\n"));
  ASSERT_NE(idle.read(5s, kStatus).find(kStatus), std::string::npos);
  EXPECT_EQ(idle.read(HttpEndpoint::kRequestDeadline + 10s), "");
  EXPECT_TRUE(idle.closed());
}

TEST(HttpLimits, TheDestructorLeavesNoThreadAndNoDescriptor) {
  const size_t fds = entries("/proc/self/fd"), threads = entries("/proc/self/task");
  {
    auto ep = endpoint();
    const int port = ep->port();
    const std::string host = "127.0.0.1:" + std::to_string(port);
    std::vector<std::unique_ptr<Socket>> clients;
    for (int i = 0; i < HttpEndpoint::kMaxStreams; ++i) {
      clients.push_back(std::make_unique<Socket>(port));
      ASSERT_TRUE(clients.back()->send(get("/api/events", host)));
      ASSERT_NE(clients.back()->read(5s, "leasehold events").find("leasehold events"),
                std::string::npos);
    }
    for (int i = 0; i < 8; ++i) {
      clients.push_back(std::make_unique<Socket>(port));
      ASSERT_TRUE(clients.back()->send("GET /api/sta"));
    }
    const auto t0 = Clock::now();
    ep.reset();
    EXPECT_LT(Clock::now() - t0, 2s) << "open streams and requests end at once";
    for (auto& c : clients) {
      c->read(5s);
      EXPECT_TRUE(c->closed());
    }
  }
  EXPECT_EQ(entries("/proc/self/fd"), fds);
  EXPECT_EQ(entries("/proc/self/task"), threads);
}

}  // namespace
}  // namespace leasehold::testing
