// The lease client's C interface (lease_client/leasehold.h, libleasehold.so)
// as the PyTorch plug-in uses it, against a real coordinator process on the
// host backend. Only the C header is used here: what these tests can do,
// a program that loads libleasehold.so can.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "lease_client/leasehold.h"
#include "tests/support/cluster.h"

extern char** environ;

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kMiB = 1ull << 20;
constexpr uint64_t kPoolBytes = 64 * kMiB;
constexpr uint64_t kAlignment = 64 * 1024;

// Sets (or with nullptr unsets) an environment variable for one test.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    if (value) {
      ::setenv(name, value, 1);
    } else {
      ::unsetenv(name);
    }
  }
  ~ScopedEnv() {
    if (old_) {
      ::setenv(name_.c_str(), old_->c_str(), 1);
    } else {
      ::unsetenv(name_.c_str());
    }
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

std::vector<std::string> environment() {
  std::vector<std::string> out;
  for (char** e = environ; *e; ++e) out.emplace_back(*e);
  std::sort(out.begin(), out.end());
  return out;
}

// A lease's bytes hold a pattern of `seed`, and still do.
void fill(lh_lease* lease, uint64_t seed) {
  auto* words = static_cast<uint64_t*>(lh_lease_data(lease));
  for (uint64_t i = 0; i < lh_lease_size(lease) / 8; ++i) words[i] = seed * 0x9E3779B97F4A7C15ull + i;
}
bool holds(const lh_lease* lease, uint64_t seed) {
  const auto* words = static_cast<const uint64_t*>(lh_lease_data(lease));
  for (uint64_t i = 0; i < lh_lease_size(lease) / 8; ++i) {
    if (words[i] != seed * 0x9E3779B97F4A7C15ull + i) return false;
  }
  return true;
}

bool contains(const char* text, const char* part) {
  return std::string(text).find(part) != std::string::npos;
}

class LeaseClient : public ::testing::Test {
 protected:
  std::vector<std::string> coordinator_args() const {
    return {"--backend", "host", "--pool-size", "64MiB", "--alignment", "64KiB",
            "--heartbeat-interval", "200ms", "--log-level", "debug"};
  }
  lh_session_options options(const char* name) const {
    lh_session_options o;
    lh_session_options_init(&o);
    o.endpoint = cluster.endpoint().c_str();
    o.name = name;
    o.register_timeout_ms = 5000;
    return o;
  }
  // Opens a session or fails the test.
  lh_session* open(const char* name) const {
    lh_session_options o = options(name);
    lh_session* s = nullptr;
    lh_status st = lh_session_open(&o, &s);
    EXPECT_EQ(st, LH_OK) << lh_status_name(st) << ": " << lh_last_error();
    return s;
  }
  Cluster cluster;
};

TEST_F(LeaseClient, OpensAndClosesSessions) {
  cluster.start_coordinator(coordinator_args());
  lh_session* s = open("plugin-a");
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(lh_session_connected(s), 1);
  EXPECT_EQ(lh_session_may_touch(s), 1);
  lh_pool_info pool;
  ASSERT_EQ(lh_session_pool(s, &pool), LH_OK) << lh_last_error();
  EXPECT_EQ(pool.cuda, 0);
  EXPECT_EQ(pool.size, kPoolBytes);
  EXPECT_EQ(pool.alignment, kAlignment);
  EXPECT_NE(pool.base, nullptr);
  lh_session_stats stats;
  ASSERT_EQ(lh_session_stats_get(s, &stats), LH_OK);
  EXPECT_EQ(stats.leases, 0u);
  EXPECT_EQ(stats.leased_bytes, 0u);
  EXPECT_EQ(stats.budget_bytes, 0u);
  ASSERT_TRUE(cluster.wait_for([](const auto& st) { return has_agent(st, "plugin-a"); }, 5s));
  lh_session_close(s);
  // Closing unregisters at once: the coordinator forgets it without waiting
  // for its heartbeats to stop.
  EXPECT_TRUE(cluster.wait_for([](const auto& st) { return !has_agent(st, "plugin-a"); }, 2s));
  lh_session_close(nullptr);  // ignored
}

TEST_F(LeaseClient, ArgumentsAreChecked) {
  EXPECT_STREQ(lh_status_name(LH_OK), "LH_OK");
  EXPECT_STREQ(lh_status_name(LH_ERR_NO_SPACE), "LH_ERR_NO_SPACE");
  EXPECT_STREQ(lh_status_name(LH_ERR_SESSION_LOST), "LH_ERR_SESSION_LOST");
  lh_session* s = reinterpret_cast<lh_session*>(0x1);
  EXPECT_EQ(lh_session_open(nullptr, nullptr), LH_ERR_INVALID_ARGUMENT);
  lh_session_options o = options("bad");
  o.job_id = 7;  // without its token
  EXPECT_EQ(lh_session_open(&o, &s), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(s, nullptr);
  EXPECT_TRUE(contains(lh_last_error(), "job_token")) << lh_last_error();
  o = options("bad");
  o.request_timeout_ms = -1;
  EXPECT_EQ(lh_session_open(&o, &s), LH_ERR_INVALID_ARGUMENT);
  lh_lease* lease = reinterpret_cast<lh_lease*>(0x1);
  EXPECT_EQ(lh_lease_acquire(nullptr, kMiB, 0, 0, &lease), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lease, nullptr);
  EXPECT_EQ(lh_lease_release(nullptr), LH_OK);
  EXPECT_EQ(lh_lease_data(nullptr), nullptr);
  EXPECT_EQ(lh_lease_lost(nullptr), 1);
  EXPECT_EQ(lh_session_connected(nullptr), 0);
  EXPECT_EQ(lh_session_stats_get(nullptr, nullptr), LH_ERR_INVALID_ARGUMENT);
}

TEST_F(LeaseClient, NoCoordinatorIsATimeoutNamingTheEndpoint) {
  lh_session_options o = options("nobody-home");
  o.register_timeout_ms = 300;
  lh_session* s = nullptr;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(lh_session_open(&o, &s), LH_ERR_TIMEOUT) << lh_last_error();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
  EXPECT_EQ(s, nullptr);
  EXPECT_TRUE(contains(lh_last_error(), cluster.endpoint().c_str())) << lh_last_error();
}

TEST_F(LeaseClient, OptionsFromTheEnvironment) {
  ScopedEnv id("LEASEHOLD_JOB_ID", nullptr);
  lh_session_options o;
  EXPECT_EQ(lh_session_options_from_env(&o), LH_ERR_NOT_FOUND);
  EXPECT_TRUE(contains(lh_last_error(), "LEASEHOLD_JOB_ID")) << lh_last_error();

  ScopedEnv endpoint("LEASEHOLD_ENDPOINT", "ipc:///tmp/somewhere.sock");
  ScopedEnv agent("LEASEHOLD_AGENT", "gpu0:worker");  // agent names may hold ':'
  ScopedEnv job("LEASEHOLD_JOB_ID", "42");
  ScopedEnv attempt("LEASEHOLD_JOB_ATTEMPT", "3");
  ScopedEnv token("LEASEHOLD_JOB_TOKEN", "0123456789abcdef00000000000000ff");
  ScopedEnv key("LEASEHOLD_CURVE_KEY", "/keys/me");
  ScopedEnv server_key("LEASEHOLD_CURVE_SERVER_KEY", "/keys/coordinator.pub");
  const auto before = environment();
  ASSERT_EQ(lh_session_options_from_env(&o), LH_OK) << lh_last_error();
  EXPECT_STREQ(o.endpoint, "ipc:///tmp/somewhere.sock");
  EXPECT_STREQ(o.name, "gpu0:worker:job42");
  EXPECT_EQ(o.job_id, 42u);
  EXPECT_EQ(o.attempt, 3u);
  EXPECT_STREQ(o.job_token, "0123456789abcdef00000000000000ff");
  EXPECT_STREQ(o.curve_key, "/keys/me");
  EXPECT_STREQ(o.curve_server_key, "/keys/coordinator.pub");
  EXPECT_EQ(o.register_timeout_ms, 0);
  EXPECT_EQ(o.request_timeout_ms, 0);
  EXPECT_EQ(environment(), before);

  // Malformed: refused, and the options are left as they were.
  {
    ScopedEnv bad("LEASEHOLD_JOB_TOKEN", "not-a-token");
    lh_session_options untouched;
    lh_session_options_init(&untouched);
    EXPECT_EQ(lh_session_options_from_env(&untouched), LH_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(lh_last_error(), "LEASEHOLD_JOB_TOKEN")) << lh_last_error();
    EXPECT_EQ(untouched.job_id, 0u);
  }
  {
    ScopedEnv bad("LEASEHOLD_JOB_ATTEMPT", nullptr);
    EXPECT_EQ(lh_session_options_from_env(&o), LH_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(contains(lh_last_error(), "LEASEHOLD_JOB_ATTEMPT")) << lh_last_error();
  }
  {
    ScopedEnv bad("LEASEHOLD_JOB_ID", "12x");
    EXPECT_EQ(lh_session_options_from_env(&o), LH_ERR_INVALID_ARGUMENT);
  }
}

// The coordinator binds a program job's session to the job's running
// attempt (Register.job_id/attempt/job_token_*, coordinator/core_programs.cpp):
// a session naming a job it does not have is refused, saying why.
TEST_F(LeaseClient, ProgramSessionOfAnUnknownJobIsRefused) {
  cluster.start_coordinator(coordinator_args());
  ScopedEnv endpoint("LEASEHOLD_ENDPOINT", cluster.endpoint().c_str());
  ScopedEnv agent("LEASEHOLD_AGENT", "some-agent");
  ScopedEnv job("LEASEHOLD_JOB_ID", "9999");
  ScopedEnv attempt("LEASEHOLD_JOB_ATTEMPT", "1");
  ScopedEnv token("LEASEHOLD_JOB_TOKEN", "00112233445566778899aabbccddeeff");
  lh_session_options o;
  ASSERT_EQ(lh_session_options_from_env(&o), LH_OK) << lh_last_error();
  o.register_timeout_ms = 3000;
  lh_session* s = nullptr;
  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(lh_session_open(&o, &s), LH_ERR_PERMISSION) << lh_last_error();
  EXPECT_EQ(s, nullptr);
  EXPECT_TRUE(contains(lh_last_error(), "job 9999")) << lh_last_error();
  // Refused at once, not retried until the registration timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s);
  EXPECT_FALSE(has_agent(*cluster.status(), "some-agent:job9999"));
}

TEST_F(LeaseClient, LeasesAreUsableMemory) {
  cluster.start_coordinator(coordinator_args());
  lh_session* s = open("plugin-leases");
  ASSERT_NE(s, nullptr);
  lh_lease* a = nullptr;
  lh_lease* b = nullptr;
  ASSERT_EQ(lh_lease_acquire(s, kMiB, 0, 0, &a), LH_OK) << lh_last_error();
  // Rounded up to the pool's alignment.
  ASSERT_EQ(lh_lease_acquire(s, 3 * kMiB + 1, -1, 1, &b), LH_OK) << lh_last_error();
  EXPECT_EQ(lh_lease_size(a), kMiB);
  EXPECT_EQ(lh_lease_size(b), 3 * kMiB + kAlignment);
  EXPECT_NE(lh_lease_id(a), 0u);
  EXPECT_NE(lh_lease_id(a), lh_lease_id(b));
  EXPECT_EQ(lh_lease_lost(a), 0);
  ASSERT_NE(lh_lease_data(a), nullptr);
  ASSERT_NE(lh_lease_data(b), nullptr);
  // Inside the pool as this process maps it, and apart.
  lh_pool_info pool;
  ASSERT_EQ(lh_session_pool(s, &pool), LH_OK);
  for (lh_lease* l : {a, b}) {
    auto* p = static_cast<std::byte*>(lh_lease_data(l));
    auto* base = static_cast<std::byte*>(pool.base);
    EXPECT_GE(p, base);
    EXPECT_LE(p + lh_lease_size(l), base + pool.size);
  }
  fill(a, 1);
  fill(b, 2);
  EXPECT_TRUE(holds(a, 1));
  EXPECT_TRUE(holds(b, 2));

  lh_session_stats stats;
  ASSERT_EQ(lh_session_stats_get(s, &stats), LH_OK);
  EXPECT_EQ(stats.leases, 2u);
  EXPECT_EQ(stats.leased_bytes, lh_lease_size(a) + lh_lease_size(b));
  const uint64_t total = stats.leased_bytes;
  EXPECT_TRUE(cluster.wait_for([&](const auto& st) { return leased_by(st, "plugin-leases") == total; },
                               2s));

  EXPECT_EQ(lh_lease_release(a), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_session_stats_get(s, &stats), LH_OK);
  EXPECT_EQ(stats.leases, 1u);
  EXPECT_EQ(stats.leased_bytes, lh_lease_size(b));
  EXPECT_TRUE(holds(b, 2));
  // Released from another thread than the one that acquired it.
  std::thread([&] { EXPECT_EQ(lh_lease_release(b), LH_OK) << lh_last_error(); }).join();
  ASSERT_EQ(lh_session_stats_get(s, &stats), LH_OK);
  EXPECT_EQ(stats.leases, 0u);
  EXPECT_TRUE(cluster.wait_for([](const auto& st) { return st["leases"].empty(); }, 2s));
  lh_session_close(s);
}

TEST_F(LeaseClient, WindowsShowPagesOfLeasesWhereAsked) {
  cluster.start_coordinator(coordinator_args());
  lh_session* s = open("plugin-window");
  ASSERT_NE(s, nullptr);
  lh_lease* a = nullptr;
  lh_lease* b = nullptr;
  ASSERT_EQ(lh_lease_acquire(s, 2 * kAlignment, 0, 0, &a), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_lease_acquire(s, 3 * kAlignment, 0, 0, &b), LH_OK) << lh_last_error();
  fill(a, 1);
  fill(b, 2);
  lh_window* w = nullptr;
  ASSERT_EQ(lh_window_open(s, 8 * kAlignment - 1, &w), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_window_size(w), 8 * kAlignment);
  ASSERT_EQ(lh_window_page_size(w), kAlignment);
  auto* base = static_cast<std::byte*>(lh_window_base(w));
  ASSERT_NE(base, nullptr);
  // Page 0 shows a's second page; pages 1-3 show all of b: one range of
  // the window backed by two leases.
  ASSERT_EQ(lh_window_show(w, 0, a, kAlignment, kAlignment), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_window_show(w, kAlignment, b, 0, 3 * kAlignment), LH_OK) << lh_last_error();
  auto* pa = static_cast<std::byte*>(lh_lease_data(a));
  auto* pb = static_cast<std::byte*>(lh_lease_data(b));
  EXPECT_EQ(std::memcmp(base, pa + kAlignment, kAlignment), 0);
  EXPECT_EQ(std::memcmp(base + kAlignment, pb, 3 * kAlignment), 0);
  // The same memory: a write through the window shows in the lease.
  const std::byte was = pb[5];
  base[kAlignment + 5] = ~was;
  EXPECT_EQ(pb[5], ~was);
  base[kAlignment + 5] = was;

  // Misuse is refused, naming what was wrong; nothing changes.
  EXPECT_EQ(lh_window_show(w, 1, a, 0, kAlignment), LH_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lh_last_error()).find("multiples of the page size"), std::string::npos);
  EXPECT_EQ(lh_window_show(w, 8 * kAlignment, a, 0, kAlignment), LH_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lh_last_error()).find("outside the window"), std::string::npos);
  EXPECT_EQ(lh_window_show(w, 4 * kAlignment, a, kAlignment, 2 * kAlignment),
            LH_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lh_last_error()).find("outside lease"), std::string::npos);
  EXPECT_EQ(lh_window_show(w, 3 * kAlignment, a, 0, 2 * kAlignment), LH_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lh_last_error()).find("shows a lease's memory already"),
            std::string::npos);
  EXPECT_EQ(lh_window_show(nullptr, 0, a, 0, kAlignment), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lh_window_hide(w, 0, 1), LH_ERR_INVALID_ARGUMENT);
  lh_window* none = nullptr;
  EXPECT_EQ(lh_window_open(s, 0, &none), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(none, nullptr);

  // A lease with pages shown stays: releasing it is refused until they are
  // hidden, so the window never shows memory the coordinator handed on.
  EXPECT_EQ(lh_lease_release(a), LH_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(lh_last_error()).find("shown in a window"), std::string::npos);
  EXPECT_TRUE(holds(a, 1));
  ASSERT_EQ(lh_window_hide(w, 0, 2 * kAlignment), LH_OK) << lh_last_error();
  EXPECT_EQ(lh_lease_release(a), LH_OK) << lh_last_error();
  // Page 1 (b's first) went with the hide; b's other pages still show.
  EXPECT_EQ(std::memcmp(base + 2 * kAlignment, pb + kAlignment, 2 * kAlignment), 0);
  EXPECT_EQ(lh_lease_release(b), LH_ERR_INVALID_ARGUMENT);
  // A hidden page may show another page.
  ASSERT_EQ(lh_window_show(w, kAlignment, b, 2 * kAlignment, kAlignment), LH_OK)
      << lh_last_error();
  EXPECT_EQ(std::memcmp(base + kAlignment, pb + 2 * kAlignment, kAlignment), 0);
  lh_window_close(w);  // hides the rest
  EXPECT_TRUE(holds(b, 2));
  EXPECT_EQ(lh_lease_release(b), LH_OK) << lh_last_error();
  lh_window_close(nullptr);

  // Closing the session (its leases go back) hides what its windows show:
  // the lease is then released as any lost one, and the window closes.
  lh_lease* c = nullptr;
  ASSERT_EQ(lh_lease_acquire(s, kAlignment, 0, 0, &c), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_window_open(s, 4 * kAlignment, &w), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_window_show(w, 2 * kAlignment, c, 0, kAlignment), LH_OK) << lh_last_error();
  lh_session_close(s);
  EXPECT_EQ(lh_lease_release(c), LH_OK) << lh_last_error();
  lh_window_close(w);
}

TEST_F(LeaseClient, RegionsAreFilledOnceAndAttachedInPlace) {
  cluster.start_coordinator(coordinator_args());
  lh_session* filler = open("plugin-filler");
  lh_session* reader = open("plugin-reader");
  ASSERT_NE(filler, nullptr);
  ASSERT_NE(reader, nullptr);
  lh_region* missing = nullptr;
  EXPECT_EQ(lh_region_attach(reader, "ds/none", 0, 0, 0, &missing), LH_ERR_NOT_FOUND);
  EXPECT_EQ(missing, nullptr);
  EXPECT_TRUE(contains(lh_last_error(), "ds/none")) << lh_last_error();

  lh_region* r = nullptr;
  ASSERT_EQ(lh_region_attach(filler, "ds/mnist", 3 * kAlignment, 1, -1, &r), LH_OK)
      << lh_last_error();
  ASSERT_EQ(lh_region_must_fill(r), 1);
  EXPECT_GE(lh_region_size(r), 3 * kAlignment);
  auto* bytes = static_cast<unsigned char*>(lh_region_data(r));
  ASSERT_NE(bytes, nullptr);
  for (uint64_t i = 0; i < lh_region_size(r); ++i) bytes[i] = static_cast<unsigned char>(i * 7);
  ASSERT_EQ(lh_region_mark_ready(r), LH_OK) << lh_last_error();
  EXPECT_EQ(lh_region_must_fill(r), 0);
  EXPECT_EQ(lh_region_mark_ready(r), LH_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(lh_last_error(), "marked ready already")) << lh_last_error();

  // Another session gets the same bytes, in place, whatever size it asks
  // with 0; a different size is refused.
  lh_region* again = nullptr;
  ASSERT_EQ(lh_region_attach(reader, "ds/mnist", 0, 0, -1, &again), LH_OK) << lh_last_error();
  EXPECT_EQ(lh_region_must_fill(again), 0);
  ASSERT_EQ(lh_region_size(again), lh_region_size(r));
  const auto* seen = static_cast<const unsigned char*>(lh_region_data(again));
  ASSERT_NE(seen, nullptr);
  EXPECT_EQ(std::memcmp(seen, bytes, lh_region_size(r)), 0);
  lh_region* other = nullptr;
  EXPECT_EQ(lh_region_attach(reader, "ds/mnist", 5 * kAlignment, 1, -1, &other),
            LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(other, nullptr);

  // Bad arguments name what was wrong.
  EXPECT_EQ(lh_region_attach(reader, "/abs", 1, 1, -1, &other), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lh_region_attach(reader, "x", 0, 1, -1, &other), LH_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(contains(lh_last_error(), "0 bytes")) << lh_last_error();
  EXPECT_EQ(lh_region_attach(reader, "x", 1, 1, -2, &other), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lh_region_attach(reader, "x", 1, 8, -1, &other), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lh_region_attach(reader, "x", 1, LH_REGION_REPLACE, -1, &other),
            LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lh_region_attach(nullptr, "x", 1, 1, -1, &other), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lh_region_mark_ready(nullptr), LH_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(lh_region_data(nullptr), nullptr);
  EXPECT_EQ(lh_region_detach(nullptr), LH_OK);

  // Detached by both, it stays resident for the next attacher.
  EXPECT_EQ(lh_region_detach(r), LH_OK) << lh_last_error();
  EXPECT_EQ(lh_region_detach(again), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_region_attach(reader, "ds/mnist", 0, 0, 0, &again), LH_OK) << lh_last_error();
  seen = static_cast<const unsigned char*>(lh_region_data(again));
  ASSERT_NE(seen, nullptr);
  EXPECT_EQ(seen[11], static_cast<unsigned char>(77));
  // Replaced while attached: refused; once nobody is, new contents.
  lh_region* newer = nullptr;
  EXPECT_NE(lh_region_attach(filler, "ds/mnist", lh_region_size(again),
                             LH_REGION_CREATE | LH_REGION_REPLACE, 0, &newer),
            LH_OK);
  EXPECT_EQ(lh_region_detach(again), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_region_attach(filler, "ds/mnist", 3 * kAlignment,
                             LH_REGION_CREATE | LH_REGION_REPLACE, 0, &newer),
            LH_OK)
      << lh_last_error();
  EXPECT_EQ(lh_region_must_fill(newer), 1);
  EXPECT_EQ(lh_region_detach(newer), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_region_attach(reader, "ds/mnist", 0, 0, 0, &again), LH_ERR_NOT_FOUND)
      << "left unfilled, it is discarded";
  ASSERT_EQ(lh_region_attach(reader, "ds/mnist", kAlignment, LH_REGION_CREATE, 0, &again), LH_OK)
      << lh_last_error();
  // A region outlives the session's handle: its handle is void, then freed.
  lh_session_close(reader);
  EXPECT_EQ(lh_region_data(again), nullptr);
  EXPECT_EQ(lh_region_detach(again), LH_OK) << lh_last_error();
  lh_session_close(filler);
}

TEST_F(LeaseClient, RefusalsSayWhy) {
  cluster.start_coordinator(coordinator_args());
  lh_session* s = open("plugin-refused");
  lh_session* other = open("plugin-holder");
  ASSERT_NE(s, nullptr);
  ASSERT_NE(other, nullptr);
  lh_lease* lease = reinterpret_cast<lh_lease*>(0x1);

  auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(lh_lease_acquire(s, 2 * kPoolBytes, -1, 0, &lease), LH_ERR_TOO_LARGE);
  EXPECT_EQ(lease, nullptr);
  EXPECT_TRUE(contains(lh_last_error(), "can never fit")) << lh_last_error();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s) << "refused at once, not queued";

  lh_lease* big = nullptr;
  ASSERT_EQ(lh_lease_acquire(other, 56 * kMiB, 0, 0, &big), LH_OK) << lh_last_error();
  EXPECT_EQ(lh_lease_acquire(s, 16 * kMiB, 0, 0, &lease), LH_ERR_NO_SPACE);
  EXPECT_EQ(lease, nullptr);
  EXPECT_TRUE(contains(lh_last_error(), "no room")) << lh_last_error();
  // Waiting, but not long enough.
  EXPECT_EQ(lh_lease_acquire(s, 16 * kMiB, 300, 0, &lease), LH_ERR_TIMEOUT);
  EXPECT_TRUE(contains(lh_last_error(), "deadline")) << lh_last_error();
  // Messages are per thread: another thread's failure leaves ours.
  const std::string ours = lh_last_error();
  std::thread([&] {
    lh_lease* l = nullptr;
    EXPECT_EQ(lh_lease_acquire(s, 2 * kPoolBytes, 0, 0, &l), LH_ERR_TOO_LARGE);
  }).join();
  EXPECT_EQ(ours, lh_last_error());

  EXPECT_EQ(lh_lease_release(big), LH_OK);
  ASSERT_EQ(lh_lease_acquire(s, 16 * kMiB, 0, 0, &lease), LH_OK) << lh_last_error();
  EXPECT_EQ(lh_lease_release(lease), LH_OK);
  lh_session_close(other);
  lh_session_close(s);
}

TEST_F(LeaseClient, ASessionLostToARestartRegistersAgain) {
  auto& first = cluster.start_coordinator(coordinator_args());
  lh_session* s = open("plugin-restart");
  ASSERT_NE(s, nullptr);
  lh_lease* old = nullptr;
  ASSERT_EQ(lh_lease_acquire(s, kMiB, 0, 0, &old), LH_OK) << lh_last_error();
  fill(old, 7);

  first.signal(SIGTERM);
  ASSERT_TRUE(first.wait(5s));
  // The coordinator's Shutdown ends the session: the lease is void.
  auto deadline = std::chrono::steady_clock::now() + 5s;
  while (lh_lease_lost(old) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  EXPECT_EQ(lh_lease_lost(old), 1);
  EXPECT_EQ(lh_lease_data(old), nullptr);
  EXPECT_EQ(lh_session_connected(s), 0);
  EXPECT_EQ(lh_session_may_touch(s), 0);
  lh_lease* none = nullptr;
  EXPECT_EQ(lh_lease_acquire(s, kMiB, 0, 0, &none), LH_ERR_SESSION_LOST);
  EXPECT_TRUE(contains(lh_last_error(), "not registered")) << lh_last_error();
  lh_session_stats stats;
  ASSERT_EQ(lh_session_stats_get(s, &stats), LH_OK);
  EXPECT_EQ(stats.leases, 0u) << "a lost lease is not the session's any more";

  cluster.start_coordinator(coordinator_args());
  deadline = std::chrono::steady_clock::now() + 10s;
  while (lh_session_connected(s) == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_EQ(lh_session_connected(s), 1);
  EXPECT_TRUE(cluster.wait_for([](const auto& st) { return has_agent(st, "plugin-restart"); }, 5s));
  // The new coordinator's pool: new leases are usable, the old one stays void.
  lh_pool_info pool;
  ASSERT_EQ(lh_session_pool(s, &pool), LH_OK);
  EXPECT_NE(pool.base, nullptr);
  lh_lease* fresh = nullptr;
  ASSERT_EQ(lh_lease_acquire(s, kMiB, 0, 0, &fresh), LH_OK) << lh_last_error();
  fill(fresh, 8);
  EXPECT_TRUE(holds(fresh, 8));
  EXPECT_EQ(lh_lease_lost(old), 1);
  // Nothing to give back for the lost one.
  EXPECT_EQ(lh_lease_release(old), LH_OK) << lh_last_error();
  ASSERT_EQ(lh_session_stats_get(s, &stats), LH_OK);
  EXPECT_EQ(stats.leases, 1u);
  EXPECT_EQ(lh_lease_release(fresh), LH_OK);
  lh_session_close(s);
}

TEST_F(LeaseClient, LeasesOutliveTheirSession) {
  cluster.start_coordinator(coordinator_args());
  lh_session* s = open("plugin-closed");
  ASSERT_NE(s, nullptr);
  lh_lease* lease = nullptr;
  ASSERT_EQ(lh_lease_acquire(s, kMiB, 0, 0, &lease), LH_OK) << lh_last_error();
  lh_session_close(s);
  // Closed: the coordinator has it back; the handle is void but still freed.
  EXPECT_EQ(lh_lease_lost(lease), 1);
  EXPECT_EQ(lh_lease_data(lease), nullptr);
  EXPECT_TRUE(cluster.wait_for([](const auto& st) { return st["leases"].empty(); }, 2s));
  EXPECT_EQ(lh_lease_release(lease), LH_OK);
}

TEST_F(LeaseClient, ManySessionsInOneProcess) {
  cluster.start_coordinator(coordinator_args());
  constexpr int kSessions = 6;
  std::vector<lh_session*> sessions(kSessions, nullptr);
  std::vector<lh_lease*> leases(kSessions, nullptr);
  std::vector<std::string> names;
  for (int i = 0; i < kSessions; ++i) names.push_back("plugin-" + std::to_string(i));
  // Opened, leased and written from threads of their own at once.
  std::vector<std::thread> threads;
  for (int i = 0; i < kSessions; ++i) {
    threads.emplace_back([&, i] {
      // The first two take the default name ("HOST-PID", then "HOST-PID-N").
      lh_session_options o = options(i < 2 ? nullptr : names[i].c_str());
      ASSERT_EQ(lh_session_open(&o, &sessions[i]), LH_OK) << lh_last_error();
      ASSERT_EQ(lh_lease_acquire(sessions[i], 2 * kMiB, 5000, 0, &leases[i]), LH_OK)
          << lh_last_error();
      fill(leases[i], 100 + i);
    });
  }
  for (auto& t : threads) t.join();
  ASSERT_FALSE(::testing::Test::HasFailure());
  for (int i = 0; i < kSessions; ++i) {
    EXPECT_TRUE(holds(leases[i], 100 + i)) << "session " << i;
    EXPECT_EQ(lh_session_connected(sessions[i]), 1);
  }
  auto st = *cluster.status();
  EXPECT_EQ(st["agents"].size(), static_cast<size_t>(kSessions)) << st.dump(2);
  EXPECT_EQ(st["leases"].size(), static_cast<size_t>(kSessions));
  EXPECT_TRUE(leases_disjoint(st));
  for (int i = 0; i < kSessions; ++i) {
    EXPECT_EQ(lh_lease_release(leases[i]), LH_OK);
    lh_session_close(sessions[i]);
  }
  EXPECT_TRUE(cluster.wait_for([](const auto& s) { return s["agents"].empty(); }, 2s));
}

// A Shrink reaches a session only while it holds memory of a running job
// (coordinator/core_shrinks.cpp: agents with a memory job); a session of
// job 0, all these tests can make without a program job, never gets one.
// What is checked: installing and removing the handler, and that an answer
// to a Shrink never asked is refused, saying so.
TEST_F(LeaseClient, ShrinkHandlerAndAnswers) {
  cluster.start_coordinator(coordinator_args());
  lh_session* s = open("plugin-shrink");
  ASSERT_NE(s, nullptr);
  std::atomic<int> calls{0};
  lh_session_set_shrink_handler(
      s, [](void* user, uint64_t, uint64_t) { ++*static_cast<std::atomic<int>*>(user); }, &calls);
  lh_session_set_shrink_handler(s, nullptr, nullptr);
  lh_session_set_shrink_handler(
      s, [](void* user, uint64_t, uint64_t) { ++*static_cast<std::atomic<int>*>(user); }, &calls);
  EXPECT_EQ(lh_session_shrink_done(s, 12345, 0, 0, nullptr), LH_ERR_INTERNAL);
  EXPECT_TRUE(contains(lh_last_error(), "was not asked")) << lh_last_error();
  EXPECT_EQ(lh_session_shrink_done(s, 12345, 0, 0, "nothing to give"), LH_ERR_INTERNAL);
  EXPECT_EQ(lh_session_shrink_done(nullptr, 1, 0, 0, nullptr), LH_ERR_INVALID_ARGUMENT);
  std::this_thread::sleep_for(300ms);  // a heartbeat or so: nothing is asked
  EXPECT_EQ(calls.load(), 0);
  lh_session_close(s);  // with the handler still installed
}

// Inside somebody else's process the environment is theirs: opening,
// leasing and closing change no variable (the agent's own session joins
// the coordinator's MPS daemon by setting CUDA_MPS_PIPE_DIRECTORY; this
// library never does).
TEST_F(LeaseClient, LeavesTheEnvironmentAlone) {
  cluster.start_coordinator(coordinator_args());
  ScopedEnv mps("CUDA_MPS_PIPE_DIRECTORY", nullptr);
  const auto before = environment();
  lh_session* s = open("plugin-env");
  ASSERT_NE(s, nullptr);
  lh_lease* lease = nullptr;
  ASSERT_EQ(lh_lease_acquire(s, kMiB, 0, 0, &lease), LH_OK) << lh_last_error();
  EXPECT_EQ(lh_lease_release(lease), LH_OK);
  lh_session_close(s);
  EXPECT_EQ(std::getenv("CUDA_MPS_PIPE_DIRECTORY"), nullptr);
  EXPECT_EQ(environment(), before);
}

}  // namespace
}  // namespace leasehold::testing
