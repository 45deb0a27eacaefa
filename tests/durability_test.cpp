// The coordinator never loses a job, with real processes on the host
// backend: SIGKILLed coordinators while jobs are submitted and running,
// agents killed mid-job, a corrupt store, files that would block.
#include <gtest/gtest.h>
#include <signal.h>
#include <sqlite3.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
using Steady = std::chrono::steady_clock;

double ms_since(Steady::time_point t0) {
  return std::chrono::duration<double, std::milli>(Steady::now() - t0).count();
}

class Durability : public ::testing::Test {
 protected:
  void SetUp() override {
    write_synthetic_idx(cluster.dir(), "train", 600, 1);
    write_synthetic_idx(cluster.dir(), "test", 150, 2);
    coordinator = &cluster.start_coordinator(coordinator_args());
  }
  std::vector<std::string> coordinator_args() const {
    return {"--backend", test_backend(), "--pool-size", "512MiB", "--alignment", "1MiB",
            "--heartbeat-interval", "200ms", "--recovery-grace", "3s"};
  }
  std::string job_file(const std::string& name, const std::string& extra, int hidden = 16) {
    std::string path = cluster.dir() + "/" + name + ".json";
    std::ofstream(path) << synthetic_job_json(cluster.dir(), name, extra, hidden);
    return path;
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    return cluster.client(std::move(args));
  }
  nlohmann::json jobs() {
    auto [rc, out] = client({"jobs", "-o", "json"});
    if (rc != 0) return nlohmann::json::array();
    return nlohmann::json::parse(out);
  }
  nlohmann::json job(uint64_t id) { return cluster.job(id); }
  bool wait_job(uint64_t id, const std::function<bool(const nlohmann::json&)>& pred,
                std::chrono::milliseconds timeout) {
    return cluster.wait_job(id, pred, timeout);
  }
  // Kills the agent running job `id` once it has reported epoch `epoch`
  // (it is then inside the next epoch).
  void kill_after_epoch(Process& agent, uint64_t id, int epoch) {
    std::string line = "job " + std::to_string(id) + " epoch " + std::to_string(epoch) + ":";
    ASSERT_TRUE(agent.wait_for_log(line, 60s)) << agent.log() << coordinator->log();
    agent.signal(SIGKILL);
    ASSERT_TRUE(agent.wait(5s));
  }
  Cluster cluster;
  Process* coordinator = nullptr;
};

TEST_F(Durability, CoordinatorKilledTwentyTimesLosesNoJob) {
  auto& agent1 = cluster.start_agent("a1", {});
  auto& agent2 = cluster.start_agent("a2", {});
  const std::string file = job_file("loop", R"(, "epochs": 3)");
  const std::string client_bin = bin_dir() + "/leasehold";

  // A client submitting in a loop, in its own thread (its own processes).
  std::atomic<bool> submitting{true};
  std::mutex mu;
  std::vector<uint64_t> printed;
  int refused = 0;
  std::thread submitter([&] {
    for (int n = 0; submitting.load(); ++n) {
      Process p({client_bin, "--endpoint", cluster.endpoint(), "--timeout", "2s", "submit", file},
                cluster.dir() + "/submit-" + std::to_string(n) + ".log");
      auto rc = p.wait(30s);
      std::lock_guard lock(mu);
      if (rc && *rc == 0) {
        // The id is the last line: a retry (the coordinator was killed
        // while answering) says so on standard error first.
        std::string log = p.log();
        while (!log.empty() && log.back() == '\n') log.pop_back();
        printed.push_back(std::stoull(log.substr(log.rfind('\n') + 1)));
      } else {
        ++refused;
      }
      std::this_thread::sleep_for(50ms);
    }
  });

  std::mt19937 rng(7);
  std::vector<double> answer_ms, agents_ms;
  const int kKills = 20;
  // Stop the submitter before any early return (a joinable thread must not
  // be destroyed).
  auto stop_submitting = [&] {
    submitting.store(false);
    if (submitter.joinable()) submitter.join();
  };
  struct Joiner {
    std::function<void()> f;
    ~Joiner() { f(); }
  } joiner{stop_submitting};  // also when start_coordinator throws
  for (int k = 0; k < kKills; ++k) {
    std::this_thread::sleep_for(std::chrono::milliseconds(300 + rng() % 600));
    coordinator->signal(SIGKILL);
    if (!coordinator->wait(5s)) {
      stop_submitting();
      FAIL() << "the coordinator did not die";
    }
    auto t0 = Steady::now();
    coordinator = &cluster.start_coordinator(coordinator_args());
    answer_ms.push_back(ms_since(t0));
    if (!cluster.wait_for(
            [](const auto& s) { return has_agent(s, "a1") && has_agent(s, "a2"); }, 20s)) {
      stop_submitting();
      FAIL() << "the agents did not register again after restart " << k + 1 << ":\n"
             << coordinator->log() << agent1.log() << agent2.log();
    }
    agents_ms.push_back(ms_since(t0));
  }
  stop_submitting();

  // Every job finishes, none lost, none twice.
  nlohmann::json list;
  auto all_done = [&] {
    list = jobs();
    if (list.empty()) return false;
    for (const auto& j : list) {
      if (j["state"] == "queued" || j["state"] == "running") return false;
    }
    return true;
  };
  auto deadline = Steady::now() + 120s;
  while (!all_done() && Steady::now() < deadline) std::this_thread::sleep_for(200ms);
  ASSERT_TRUE(all_done()) << list.dump(1) << coordinator->log();

  std::map<uint64_t, nlohmann::json> by_id;
  for (const auto& j : list) {
    EXPECT_TRUE(by_id.emplace(j["id"].get<uint64_t>(), j).second) << "id listed twice: " << j["id"];
  }
  std::set<uint64_t> printed_set(printed.begin(), printed.end());
  EXPECT_EQ(printed_set.size(), printed.size()) << "submit printed an id twice";
  int lost = 0, runs = 0, not_succeeded = 0;
  for (uint64_t id : printed) {
    if (!by_id.count(id)) {
      ++lost;
      ADD_FAILURE() << "job " << id << " was acknowledged but is gone";
    }
  }
  for (const auto& [id, j] : by_id) {
    runs += j["attempts"].get<int>();
    if (j["state"] != "succeeded") {
      ++not_succeeded;
      ADD_FAILURE() << "job " << id << " ended " << j["state"] << ": " << j["reason"];
    }
    EXPECT_EQ(j["epochs_total"], 3) << "job " << id << ": every epoch's result is there";
    // Its runs follow one another; none overlaps the next.
    const auto& runs_of = j["attempt_history"];
    for (size_t a = 1; a < runs_of.size(); ++a) {
      EXPECT_LE(runs_of[a - 1]["ended_ms"].get<uint64_t>(), runs_of[a]["started_ms"].get<uint64_t>())
          << "job " << id << " ran twice at once: " << runs_of.dump();
    }
    // An interrupted run says what happened, not a misleading out-of-memory.
    for (const auto& h : j["history"]) {
      std::string reason = h["reason"];
      EXPECT_EQ(reason.find("out of memory"), std::string::npos) << "job " << id << ": " << reason;
    }
  }
  EXPECT_GE(printed.size(), 5u) << "the loop submitted too little to mean anything";
  double answer_max = *std::max_element(answer_ms.begin(), answer_ms.end());
  double agents_max = *std::max_element(agents_ms.begin(), agents_ms.end());
  double answer_mean = 0, agents_mean = 0;
  for (double v : answer_ms) answer_mean += v / kKills;
  for (double v : agents_ms) agents_mean += v / kKills;
  std::printf(
      "crash loop: %d coordinator SIGKILLs, %zu jobs acknowledged, %d submissions refused while "
      "it was down, %zu jobs stored, %d lost, %d not succeeded, %d runs in all; restart to "
      "answering: mean %.0f ms, max %.0f ms; to both agents registered again: mean %.0f ms, max "
      "%.0f ms\n",
      kKills, printed.size(), refused, by_id.size(), lost, not_succeeded, runs, answer_mean,
      answer_max, agents_mean, agents_max);
}

TEST_F(Durability, AJobSurvivesItsAgentKilledThreeTimesWithTheSameAccuracy) {
  // Bigger data and a wider layer: epochs long enough to be killed inside.
  write_synthetic_idx(cluster.dir(), "train", 4000, 1);
  const std::string extra = R"(, "epochs": 6, "batch_size": 16)";
  // The uninterrupted run.
  auto& ref = cluster.start_agent("ref", {});
  auto [rc, out] = client({"submit", job_file("steady", extra, 512), "--follow"});
  ASSERT_EQ(rc, 0) << out << ref.log();
  const double reference = job(1)["test_accuracy"].get<double>();
  ref.signal(SIGTERM);
  ASSERT_TRUE(ref.wait(10s));

  auto [rc2, out2] = client({"submit", job_file("killed", extra, 512)});
  ASSERT_EQ(rc2, 0) << out2;
  const uint64_t id = std::stoull(out2);
  for (int kill = 1; kill <= 3; ++kill) {
    auto& w = cluster.start_agent("w" + std::to_string(kill), {});
    kill_after_epoch(w, id, kill);
  }
  auto& last = cluster.start_agent("w4", {});
  ASSERT_TRUE(wait_job(id, [](const auto& j) { return j["state"] == "succeeded"; }, 120s))
      << job(id).dump(1) << last.log();
  auto j = job(id);
  EXPECT_EQ(j["attempts"], 4);
  EXPECT_EQ(j["resumed_from_epoch"], 3);
  EXPECT_EQ(j["epochs_total"], 6) << "no epoch's result lost to a kill";
  EXPECT_EQ(j["test_accuracy"].get<double>(), reference)
      << "a resumed run is the uninterrupted run";
  EXPECT_NE(j["checkpoint"].get<std::string>().find("/checkpoints/" + std::to_string(id) + "/"),
            std::string::npos)
      << j["checkpoint"];
  ASSERT_EQ(j["attempt_history"].size(), 4u);
  for (int a = 0; a < 3; ++a) {
    const auto& h = j["attempt_history"][a];
    EXPECT_EQ(h["outcome"], "agent lost") << h.dump();
    EXPECT_EQ(h["cause"], "agent_died") << h.dump();
    EXPECT_EQ(h["agent"], "w" + std::to_string(a + 1));
    EXPECT_EQ(h["resumed_from_epoch"], a) << h.dump();
  }
  EXPECT_EQ(j["attempt_history"][3]["outcome"], "succeeded");
  EXPECT_EQ(j["interruptions"], nlohmann::json({{"agent_died", 3}})) << j.dump(1);
  EXPECT_NE(last.log().find("resumes after epoch 3"), std::string::npos) << last.log();
  // What the operator sees.
  auto [trc, table] = client({"jobs"});
  EXPECT_NE(table.find("ATTEMPTS"), std::string::npos) << table;
  EXPECT_NE(table.find("INTERRUPTED"), std::string::npos) << table;
  auto [drc, text] = client({"job", std::to_string(id)});
  EXPECT_NE(text.find("attempts: 4; interrupted 3 times (3 agent died); 3 of"), std::string::npos)
      << text;
  EXPECT_NE(text.find("resumed from epoch 3"), std::string::npos) << text;
}

TEST_F(Durability, AJobFailsWithEveryAttemptsReasonAfterMaxAttempts) {
  write_synthetic_idx(cluster.dir(), "train", 4000, 1);
  auto [rc, out] =
      client({"submit", job_file("fragile", R"(, "epochs": 6, "batch_size": 16, "max_attempts": 1)",
                                 512)});
  ASSERT_EQ(rc, 0) << out;
  const uint64_t id = std::stoull(out);
  for (int kill = 1; kill <= 2; ++kill) {
    auto& w = cluster.start_agent("f" + std::to_string(kill), {});
    kill_after_epoch(w, id, kill);
  }
  ASSERT_TRUE(wait_job(id, [](const auto& j) { return j["state"] == "failed"; }, 20s))
      << job(id).dump(1);
  std::string reason = job(id)["reason"];
  EXPECT_NE(reason.find("gave up after 2 attempts"), std::string::npos) << reason;
  EXPECT_NE(reason.find("agent 'f1'"), std::string::npos) << reason;
  EXPECT_NE(reason.find("agent 'f2'"), std::string::npos) << reason;
}

TEST_F(Durability, QueuedJobsAndTheirOrderSurviveARestart) {
  // No agent: everything stays queued across a SIGKILL.
  std::vector<uint64_t> ids;
  for (int i = 0; i < 4; ++i) {
    auto [rc, out] = client({"submit", job_file("q" + std::to_string(i), R"(, "epochs": 1)"),
                             "--priority", i == 2 ? "5" : "0"});
    ASSERT_EQ(rc, 0) << out;
    ids.push_back(std::stoull(out));
  }
  coordinator->signal(SIGKILL);
  ASSERT_TRUE(coordinator->wait(5s));
  coordinator = &cluster.start_coordinator(coordinator_args());
  auto list = jobs();
  ASSERT_EQ(list.size(), 4u) << list.dump(1);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(list[i]["id"], ids[i]);
    EXPECT_EQ(list[i]["state"], "queued");
  }
  auto [rc, out] = client({"submit", job_file("after", R"(, "epochs": 1)")});
  EXPECT_EQ(std::stoull(out), ids.back() + 1) << "ids are not reused";
  // One agent runs them in queue order: the priority-5 job first.
  cluster.start_agent("solo", {});
  ASSERT_TRUE(wait_job(ids.back() + 1, [](const auto& j) { return j["state"] == "succeeded"; },
                       60s));
  auto started = [&](uint64_t id) { return job(id)["attempt_history"][0]["started_ms"].get<uint64_t>(); };
  EXPECT_LT(started(ids[2]), started(ids[0]));
  EXPECT_LT(started(ids[0]), started(ids[1]));
  EXPECT_LT(started(ids[1]), started(ids[3]));
}

// While the store cannot commit, nothing that depends on the commit leaves
// the coordinator: no acknowledgement, no assignment; it keeps answering
// everything else, and refuses new jobs with the reason.
TEST_F(Durability, AcknowledgementsAndAssignmentsWaitForTheirCommit) {
  auto& agent = cluster.start_agent("w", {});
  ASSERT_TRUE(cluster.wait_for([](const auto& s) { return has_agent(s, "w"); }, 10s));
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open((cluster.state_dir() + "/jobs.db").c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK)
      << "the test holds the store's write lock";
  const std::string file = job_file("held", R"(, "epochs": 1)");
  // Refused, with the reason, once the store fails: never left unanswered
  // (the client asks again with the same key for four timeouts, then says
  // why it gave up).
  auto [rc, out] = client({"--timeout", "2s", "submit", file});
  EXPECT_EQ(rc, 4) << "not acknowledged before it is stored: " << out;
  EXPECT_NE(out.find("job store could not commit it"), std::string::npos) << out;
  EXPECT_NE(out.find("asking again (the same submission)"), std::string::npos) << out;
  auto [rc2, out2] = client({"--timeout", "1s", "submit", file});
  EXPECT_EQ(rc2, 4) << out2;
  EXPECT_NE(out2.find("job store cannot commit"), std::string::npos) << out2;
  EXPECT_NE(out2.find("database is locked"), std::string::npos) << out2;
  EXPECT_TRUE(cluster.status().has_value()) << "the loop still answers";
  EXPECT_EQ(agent.log().find("started"), std::string::npos)
      << "an assignment left before it was stored:\n" << agent.log();
  ASSERT_EQ(sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(db);
  // Refused means not queued: nothing runs that its submitter was told
  // failed, after the store recovers either.
  ASSERT_TRUE(cluster.wait_for(
      [&](const auto&) { return coordinator->log().find("job store commits again") != std::string::npos; },
      10s))
      << coordinator->log();
  std::this_thread::sleep_for(1s);
  EXPECT_TRUE(jobs().empty()) << jobs().dump(1);
  EXPECT_EQ(agent.log().find("started"), std::string::npos) << agent.log();
  auto [rc3, out3] = client({"submit", file});
  EXPECT_EQ(rc3, 0) << "accepting again: " << out3;
  EXPECT_EQ(jobs().size(), 1u);
}

// A submission retried by its client while the store cannot commit is
// queued exactly once when the store recovers within the client's patience.
TEST_F(Durability, ASubmissionRetriedAcrossAStoreFailureIsQueuedOnce) {
  cluster.start_agent("w", {});
  sqlite3* db = nullptr;
  ASSERT_EQ(sqlite3_open((cluster.state_dir() + "/jobs.db").c_str(), &db), SQLITE_OK);
  ASSERT_EQ(sqlite3_exec(db, "BEGIN IMMEDIATE", nullptr, nullptr, nullptr), SQLITE_OK);
  std::pair<int, std::string> result;
  std::thread submitter([&] {
    result = client({"--timeout", "10s", "submit", job_file("once", R"(, "epochs": 1)")});
  });
  // Past its first refusal, well within its 40 s of retries.
  ASSERT_TRUE(cluster.wait_for(
      [&](const auto&) { return coordinator->log().find("withdrawn") != std::string::npos ||
                                coordinator->log().find("job store cannot commit") != std::string::npos; },
      20s))
      << coordinator->log();
  std::this_thread::sleep_for(2s);
  ASSERT_EQ(sqlite3_exec(db, "ROLLBACK", nullptr, nullptr, nullptr), SQLITE_OK);
  sqlite3_close(db);
  submitter.join();
  EXPECT_EQ(result.first, 0) << result.second << coordinator->log();
  const auto all = jobs();
  ASSERT_EQ(all.size(), 1u) << all.dump(1);
  EXPECT_EQ(std::to_string(all[0]["id"].get<uint64_t>()) + "\n",
            result.second.substr(result.second.rfind('\n', result.second.size() - 2) + 1))
      << result.second;
  EXPECT_TRUE(wait_job(all[0]["id"], [](const auto& j) { return j["state"] == "succeeded"; }, 30s));
}

TEST_F(Durability, ACorruptStoreStopsTheCoordinatorNamingTheFile) {
  coordinator->signal(SIGTERM);
  ASSERT_TRUE(coordinator->wait(5s));
  const std::string db = cluster.state_dir() + "/jobs.db";
  std::filesystem::remove(db + "-wal");
  std::filesystem::remove(db + "-shm");
  std::ofstream(db, std::ios::trunc) << std::string(8192, '\x5a');
  try {
    cluster.start_coordinator(coordinator_args());
    FAIL() << "a coordinator started on a corrupt store";
  } catch (const std::runtime_error& e) {
    std::string log = e.what();
    EXPECT_NE(log.find(db), std::string::npos) << log;
  }
  auto& p = *cluster.processes().back();
  EXPECT_EQ(p.wait(5s), 1);
  std::ifstream in(db, std::ios::binary);
  EXPECT_EQ(std::string(std::istreambuf_iterator<char>(in), {}), std::string(8192, '\x5a'))
      << "the store is left as it was";
}

TEST_F(Durability, ASecondCoordinatorOnTheSameStateDirectoryIsRefused) {
  std::vector<std::string> args{bin_dir() + "/leasehold-coordinator", "--endpoint",
                                "ipc://" + cluster.dir() + "/other.sock", "--state-dir",
                                cluster.state_dir()};
  for (const auto& a : coordinator_args()) args.push_back(a);
  Process second(args, cluster.dir() + "/second.log");
  EXPECT_EQ(second.wait(10s), 1);
  EXPECT_NE(second.log().find("another leasehold-coordinator uses the state directory"),
            std::string::npos)
      << second.log();
  EXPECT_TRUE(cluster.status().has_value()) << "the first one still answers";
}

TEST_F(Durability, AFifoAsDatasetIsRefusedWithoutBlockingTheCoordinator) {
  const std::string fifo = cluster.dir() + "/fifo-images";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0644), 0);
  std::string json = synthetic_job_json(cluster.dir(), "fifo", R"(, "epochs": 1)");
  json.replace(json.find(cluster.dir() + "/train-images"), (cluster.dir() + "/train-images").size(),
               fifo);
  std::string path = cluster.dir() + "/fifo.json";
  std::ofstream(path) << json;
  auto t0 = Steady::now();
  auto [rc, out] = client({"submit", path});
  EXPECT_EQ(rc, 2) << out;
  EXPECT_NE(out.find("is not a regular file"), std::string::npos) << out;
  EXPECT_LT(ms_since(t0), 10000) << "refused, not timed out";
  EXPECT_TRUE(cluster.status().has_value());
  EXPECT_TRUE(jobs().empty());
}

}  // namespace
}  // namespace leasehold::testing
