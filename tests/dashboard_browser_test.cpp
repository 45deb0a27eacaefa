// The dashboard page in a real browser: a coordinator, an agent and a
// training job; headless Chromium (Debian's `chromium`), driven over its
// DevTools protocol on a pipe (--remote-debugging-pipe: no port, no extra
// library), opens the page and waits for the pool map to show the job's
// leases and the loss curve to have points, then saves a screenshot
// (LEASEHOLD_SCREENSHOT=PATH copies it there; the README shows one).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tests/support/cluster.h"
#include "tests/support/net.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

std::string find_chromium() {
  for (const char* p : {"/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/bin/google-chrome"}) {
    if (::access(p, X_OK) == 0) return p;
  }
  return "";
}

std::string base64_decode(const std::string& in) {
  auto value = [](char c) -> int {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
  };
  std::string out;
  int bits = 0;
  uint32_t acc = 0;
  for (char c : in) {
    const int v = value(c);
    if (v < 0) continue;  // '=' padding
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(char((acc >> bits) & 0xff));
    }
  }
  return out;
}

// Chromium with the DevTools protocol on fds 3 (it reads) and 4 (it
// writes): JSON messages, each ended by a NUL byte.
class Chromium {
 public:
  Chromium(const std::string& binary, const fs::path& dir) {
    int to[2], from[2];
    if (::pipe2(to, O_CLOEXEC) != 0 || ::pipe2(from, O_CLOEXEC) != 0) {
      throw std::runtime_error("pipe2 failed");
    }
    const std::string log = (dir / "chromium.log").string();
    std::vector<std::string> args{binary,
                                  "--headless=new",
                                  "--remote-debugging-pipe",
                                  "--no-sandbox",  // tests may run as root
                                  "--disable-gpu",
                                  "--disable-dev-shm-usage",
                                  "--no-first-run",
                                  "--disable-extensions",
                                  "--hide-scrollbars",
                                  "--user-data-dir=" + (dir / "chromium-profile").string(),
                                  "--window-size=1400,820",
                                  "about:blank"};
    pid_ = ::fork();
    if (pid_ == 0) {
      // Move the pipe ends out of the way, then onto 3 and 4.
      int in = ::fcntl(to[0], F_DUPFD, 10), out = ::fcntl(from[1], F_DUPFD, 10);
      ::dup2(in, 3);
      ::dup2(out, 4);
      int logfd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(logfd, 1);
      ::dup2(logfd, 2);
      std::vector<char*> argv;
      for (auto& a : args) argv.push_back(a.data());
      argv.push_back(nullptr);
      ::execv(binary.c_str(), argv.data());
      ::_exit(127);
    }
    ::close(to[0]);
    ::close(from[1]);
    to_ = to[1];
    from_ = from[0];
    log_ = log;
  }
  ~Chromium() {
    try {
      call("Browser.close", {}, "", 5s);
    } catch (const std::exception&) {
    }
    for (int i = 0; i < 50 && ::waitpid(pid_, nullptr, WNOHANG) == 0; ++i) {
      std::this_thread::sleep_for(100ms);
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, WNOHANG);
    ::close(to_);
    ::close(from_);
  }

  // Sends a command and returns its result; throws with the error or on
  // timeout. Events that arrive meanwhile are kept in events().
  nlohmann::json call(const std::string& method, nlohmann::json params,
                      const std::string& session = "",
                      std::chrono::milliseconds timeout = 20s) {
    const int id = next_id_++;
    nlohmann::json msg{{"id", id}, {"method", method}, {"params", std::move(params)}};
    if (!session.empty()) msg["sessionId"] = session;
    std::string text = msg.dump();
    text.push_back('\0');
    if (::write(to_, text.data(), text.size()) != ssize_t(text.size())) {
      throw std::runtime_error("cannot write to Chromium (exited?): " + log());
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (true) {
      for (auto nul = buffer_.find('\0'); nul != std::string::npos; nul = buffer_.find('\0')) {
        auto reply = nlohmann::json::parse(buffer_.substr(0, nul));
        buffer_.erase(0, nul + 1);
        if (!reply.contains("id")) {
          events_.push_back(std::move(reply));
          continue;
        }
        if (reply["id"] != id) continue;
        if (reply.contains("error")) {
          throw std::runtime_error(method + ": " + reply["error"].dump());
        }
        return reply["result"];
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) throw std::runtime_error(method + ": no answer; " + log());
      pollfd p{from_, POLLIN, 0};
      if (::poll(&p, 1, int(left.count())) <= 0) continue;
      char chunk[65536];
      ssize_t n = ::read(from_, chunk, sizeof chunk);
      if (n <= 0) throw std::runtime_error("Chromium closed its pipe: " + log());
      buffer_.append(chunk, size_t(n));
    }
  }
  const std::vector<nlohmann::json>& events() const { return events_; }
  std::string log() const {
    std::ifstream in(log_);
    std::stringstream s;
    s << in.rdbuf();
    return s.str().substr(0, 4000);
  }

 private:
  pid_t pid_ = -1;
  int to_ = -1, from_ = -1;
  std::string buffer_, log_;
  int next_id_ = 1;
  std::vector<nlohmann::json> events_;
};

TEST(DashboardPage, ShowsTheJobsLeasesAndLossCurveInChromium) {
  const std::string chromium = find_chromium();
  if (chromium.empty()) {
    GTEST_SKIP() << "Chromium is not installed (deploy/setup.sh --with-test-tools installs it)";
  }
  Cluster c;
  write_synthetic_idx(c.dir(), "train", 600, 1);
  write_synthetic_idx(c.dir(), "test", 150, 2);
  const int port = free_port();
  c.start_coordinator({"--backend", "host", "--pool-size", "512MiB", "--alignment", "1MiB",
                       "--heartbeat-interval", "200ms", "--http",
                       "127.0.0.1:" + std::to_string(port)});
  c.start_agent("trainer-1", {});
  c.start_agent("trainer-2", {});
  // Two long jobs whose shares fit side by side: the example MLP on a
  // Fashion-MNIST subset (real curves for the screenshot), or on the
  // synthetic data where the dataset is not installed.
  const bool fashion = fs::exists("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz");
  for (const auto& [name, lr] : {std::pair{"mlp-adam-1e-3", 0.001}, {"mlp-adam-3e-4", 0.0003}}) {
    nlohmann::json job;
    if (fashion) {
      std::ifstream in(fs::path(LEASEHOLD_SOURCE_DIR) / "deploy/jobs/fashion-mnist-mlp.json");
      job = nlohmann::json::parse(in);
      job["dataset"]["train_limit"] = 6000;
      job["dataset"]["test_limit"] = 1000;
      job["optimizer"]["lr"] = lr;
    } else {
      job = nlohmann::json::parse(synthetic_job_json(c.dir(), name, "", 256));
    }
    job["name"] = name;
    job["epochs"] = 100000;
    job["memory_budget"] = "128MiB";
    const std::string file = c.dir() + "/" + name + ".json";
    std::ofstream(file) << job.dump(2);
    auto [rc, out] = c.run("leasehold", {"--endpoint", c.endpoint(), "submit", file});
    ASSERT_EQ(rc, 0) << out;
  }

  Chromium browser(chromium, c.dir());
  const auto target =
      browser.call("Target.createTarget", {{"url", "http://127.0.0.1:" + std::to_string(port)}});
  const std::string session = browser.call("Target.attachToTarget", {{"targetId", target["targetId"]},
                                                                     {"flatten", true}})["sessionId"];
  browser.call("Runtime.enable", nlohmann::json::object(), session);
  // A laptop's window, 1000 px high: the curves must show without scrolling.
  browser.call("Emulation.setDeviceMetricsOverride",
               {{"width", 1400}, {"height", 1000}, {"deviceScaleFactor", 1}, {"mobile", false}},
               session);
  const std::string probe = R"(JSON.stringify({
      leases: +(document.getElementById('pool')?.dataset.leases || 0),
      loss: +(document.getElementById('loss')?.dataset.points || 0),
      jobs: document.querySelectorAll('#jobs tbody tr').length,
      agents: document.querySelectorAll('#agents tbody tr').length,
      running: document.querySelectorAll('#jobs tbody td.state-running').length,
      users: [...document.querySelectorAll('#jobs tbody tr')].map(r => r.children[2].textContent),
      curves_bottom: document.getElementById('accuracy').getBoundingClientRect().bottom,
      view: window.innerHeight,
      live: document.getElementById('connection')?.textContent}))";
  nlohmann::json seen;
  const bool shown = eventually(
      [&] {
        auto r = browser.call("Runtime.evaluate", {{"expression", probe}, {"returnByValue", true}},
                              session);
        if (!r["result"]["value"].is_string()) return false;
        seen = nlohmann::json::parse(r["result"]["value"].get<std::string>());
        return seen["leases"] >= 2 && seen["loss"] >= 3 && seen["jobs"] == 2 &&
               seen["agents"] == 2 && seen["running"] == 2;
      },
      90s);
  EXPECT_TRUE(shown) << "the page showed " << seen.dump();
  EXPECT_EQ(seen["live"], "live");
  // Who submitted each job (the test's own user), and the curves above the fold.
  for (const auto& user : seen["users"]) EXPECT_NE(user, "–") << seen.dump();
  EXPECT_LE(seen["curves_bottom"].get<double>(), seen["view"].get<double>()) << seen.dump();
  // Let the occupancy chart and the curves gather a few more points.
  std::this_thread::sleep_for(6s);

  auto shot = browser.call("Page.captureScreenshot", {{"format", "png"}}, session);
  const std::string png = base64_decode(shot["data"].get<std::string>());
  ASSERT_GT(png.size(), 10000u);
  EXPECT_EQ(png.substr(1, 3), "PNG");
  const fs::path saved = fs::path(c.dir()) / "dashboard.png";
  std::ofstream(saved, std::ios::binary) << png;
  if (const char* copy = std::getenv("LEASEHOLD_SCREENSHOT")) {
    fs::copy_file(saved, copy, fs::copy_options::overwrite_existing);
    std::cout << "screenshot: " << copy << "\n";
  }
  std::cout << "page: " << seen.dump() << "\n";

  // The page ran without a script error.
  for (const auto& e : browser.events()) {
    EXPECT_NE(e.value("method", ""), "Runtime.exceptionThrown") << e.dump();
  }
}

}  // namespace
}  // namespace leasehold::testing
