// Program jobs end to end with real processes on the test backend: the
// client runs a program as a job (`leasehold run`), the agent starts it as
// its child, its output becomes the job's log, its reports the job's
// progress, its exit status the job's outcome; cancels, runaway children
// and agent deaths leave nothing running. Programs are shell scripts and
// Debian's python3 (with its CPU PyTorch where installed).
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <thread>

#include "shared/process.h"
#include "tests/support/cluster.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;
namespace fs = std::filesystem;

constexpr const char* kPython = "/usr/bin/python3";

// Under AddressSanitizer libleasehold.so is instrumented, and an
// uninstrumented python3 cannot load it (ASan's runtime must come first):
// the tests whose scripts open a session through it run in the plain pass.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

// Running (a zombie waiting for its reaper has ended).
bool pid_alive(pid_t pid) {
  auto state = process_state(pid);
  return state && *state != 'Z' && *state != 'X';
}

class ProgramJobs : public ::testing::Test {
 protected:
  void SetUp() override {
    coordinator = &cluster.start_coordinator({"--backend", test_backend(), "--pool-size",
                                              "256MiB", "--alignment", "1MiB",
                                              "--heartbeat-interval", "200ms"});
    work = cluster.dir() + "/work";
    fs::create_directories(work);
  }
  Process& agent(const std::string& name) {
    return cluster.start_agent(name, {"--program-stop-grace", "1s"});
  }
  std::string script(const std::string& name, const std::string& text) {
    const std::string path = work + "/" + name;
    std::ofstream(path) << text;
    fs::permissions(path, fs::perms::owner_all);
    return path;
  }
  // `leasehold run` from the work folder: {exit code, stdout + stderr}.
  std::pair<int, std::string> run(std::vector<std::string> command,
                                  std::vector<std::string> options = {}) {
    std::vector<std::string> args{"--endpoint", cluster.endpoint(), "run"};
    args.insert(args.end(), options.begin(), options.end());
    args.push_back("--");
    args.insert(args.end(), command.begin(), command.end());
    const auto cwd = fs::current_path();
    fs::current_path(work);
    auto result = cluster.run("leasehold", args);
    fs::current_path(cwd);
    return result;
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    return cluster.client(std::move(args));
  }
  nlohmann::json job(uint64_t id) { return cluster.job(id); }
  bool wait_job(uint64_t id, const std::function<bool(const nlohmann::json&)>& pred,
                std::chrono::milliseconds timeout) {
    return cluster.wait_job(id, pred, timeout);
  }
  // Submits a program job file for `command` (in the work folder); its id.
  uint64_t submit(const std::vector<std::string>& command, const std::string& extra = "") {
    nlohmann::json spec{{"name", "prog"},
                        {"program", {{"command", command}, {"directory", work}}}};
    if (!extra.empty()) spec.update(nlohmann::json::parse(extra));
    const std::string file = work + "/job.json";
    std::ofstream(file) << spec.dump();
    auto [rc, out] = client({"submit", file});
    EXPECT_EQ(rc, 0) << out;
    return rc == 0 ? std::stoull(out) : 0;
  }
  static pid_t read_pid(const std::string& path, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      std::ifstream in(path);
      pid_t pid = 0;
      if (in >> pid && pid > 0) return pid;
      std::this_thread::sleep_for(50ms);
    }
    return 0;
  }
  Cluster cluster;
  Process* coordinator = nullptr;
  std::string work;
};

TEST_F(ProgramJobs, RunStreamsTheOutputAndExitsWithTheProgramsStatus) {
  agent("w1");
  auto [ok, out] = run({"/bin/sh", "-c", "echo hello from $LEASEHOLD_JOB_ID; echo to stderr >&2"});
  EXPECT_EQ(ok, 0) << out;
  EXPECT_NE(out.find("hello from 1"), std::string::npos) << out;
  EXPECT_NE(out.find("to stderr"), std::string::npos) << out;
  auto [rc, failed] = run({"/bin/sh", "-c", "echo working; echo 'cannot open data.bin' >&2; exit 7"});
  EXPECT_EQ(rc, 7) << failed;
  const auto j = job(2);
  EXPECT_EQ(j["state"], "failed");
  EXPECT_EQ(j["exit_code"], 7);
  EXPECT_NE(j["reason"].get<std::string>().find("exit status 7: cannot open data.bin"),
            std::string::npos)
      << j.dump(1);
  // A program that reported no accuracy shows how it ended.
  auto [jrc, listed] = client({"jobs"});
  EXPECT_NE(listed.find("exit 0"), std::string::npos) << listed;
  // The log stays with the job.
  auto [lrc, log] = client({"logs", "2"});
  EXPECT_EQ(lrc, 0);
  EXPECT_EQ(log, "working\ncannot open data.bin\n");
  // A program killed by a signal: 128 + the signal, as a shell says.
  auto [src, sig] = run({"/bin/sh", "-c", "kill -9 $$"});
  EXPECT_EQ(src, 137) << sig;
}

TEST_F(ProgramJobs, AFloodOfOutputCostsBoundedMemoryAndKeepsItsEnd) {
  agent("w1");
  // 64 MiB of output as fast as the pipe takes it, then a last line.
  auto [rc, out] = run({"/bin/sh", "-c", "head -c 67108864 /dev/zero | tr '\\0' x; echo; echo the end"});
  EXPECT_EQ(rc, 0);
  auto [lrc, log] = client({"logs", "1"});
  EXPECT_EQ(lrc, 0);
  EXPECT_LE(log.size(), 2u << 20) << "the job's log is bounded";
  EXPECT_NE(log.find("the end"), std::string::npos) << "its end is kept";
  const auto j = job(1);
  EXPECT_EQ(j["state"], "succeeded") << j.dump(1);
}

TEST_F(ProgramJobs, BadCommandsAndFoldersAreRefusedWithTheirReason) {
  agent("w1");
  const std::string file = work + "/bad.json";
  auto refused = [&](const nlohmann::json& program) {
    std::ofstream(file) << nlohmann::json{{"name", "bad"}, {"program", program}}.dump();
    return client({"submit", file});
  };
  auto [rc1, out1] = refused({{"command", nlohmann::json::array()}, {"directory", work}});
  EXPECT_EQ(rc1, 2);
  EXPECT_NE(out1.find("program.command: required"), std::string::npos) << out1;
  auto [rc2, out2] = refused({{"command", {"true"}}, {"directory", "relative/dir"}});
  EXPECT_EQ(rc2, 2);
  EXPECT_NE(out2.find("is not an absolute path"), std::string::npos) << out2;
  auto [rc3, out3] = refused({{"command", {"true"}}, {"directory", work + "/missing"}});
  EXPECT_EQ(rc3, 2);
  EXPECT_NE(out3.find("No such file or directory"), std::string::npos) << out3;
  auto [rc4, out4] = refused({{"command", {"true"}},
                             {"directory", work},
                             {"environment", {{{"name", "LEASEHOLD_JOB_ID"}, {"value", "9"}}}}});
  EXPECT_EQ(rc4, 2);
  EXPECT_NE(out4.find("is the agent's to set"), std::string::npos) << out4;
  // Found only where it runs: the agent's PATH.
  auto [rc5, out5] = run({"no-such-program-here"});
  EXPECT_EQ(rc5, 1) << out5;
  EXPECT_NE(out5.find("'no-such-program-here' was not found on the PATH"), std::string::npos)
      << out5;
}

TEST_F(ProgramJobs, ReportsBecomeProgressAndEpochs) {
  if (!fs::exists(kPython)) GTEST_SKIP() << kPython << " is missing";
  agent("w1");
  script("report.py", R"(
import os, leasehold
j = leasehold.job()
assert j is not None and j.id == 1, j
for step in range(1, 4):
    assert leasehold.report(step=step, epoch=1, loss=1.0 / step, samples=32 * step)
    # The plug-in's memory line, as a spilling PyTorch job sends it.
    os.write(int(os.environ["LEASEHOLD_REPORT_FD"]), b'{"type": "memory", "peak_leased_bytes": %d,'
             b' "spilled_bytes": %d, "restored_bytes": %d}\n' % (step << 20, 1000 * step, 900 * step))
assert leasehold.report(epoch=1, loss=0.25, test_accuracy=0.75)
print("done", j.checkpoint_dir)
)");
  auto [rc, out] = run({kPython, "report.py"});
  EXPECT_EQ(rc, 0) << out;
  const auto j = job(1);
  EXPECT_EQ(j["state"], "succeeded") << j.dump(1);
  ASSERT_EQ(j["epochs"].size(), 1u) << j.dump(1);
  EXPECT_DOUBLE_EQ(j["epochs"][0]["test_accuracy"].get<double>(), 0.75);
  EXPECT_EQ(j["progress"]["global_step"], 3);
  // The last memory line's figures outlive the program.
  EXPECT_EQ(j["progress"]["peak_device_bytes"], 3 << 20) << j.dump(1);
  EXPECT_EQ(j["progress"]["spilled_bytes"], 3000) << j.dump(1);
  EXPECT_EQ(j["progress"]["restored_bytes"], 2700) << j.dump(1);
  EXPECT_GT(j["first_step_at_us"].get<uint64_t>(), 0u) << "the first report stamps the start";
  EXPECT_NE(out.find("done " + cluster.state_dir() + "/checkpoints/1"), std::string::npos) << out;
}

TEST_F(ProgramJobs, CancelEndsAProgramThatIgnoresSigtermAndItsGrandchildren) {
  agent("w1");
  // Ignores SIGTERM; leaves a grandchild behind in its group.
  const std::string s = script("stubborn.sh", R"(#!/bin/sh
trap '' TERM
sleep 1000 &
echo $! > grandchild.pid
echo $$ > child.pid
while true; do sleep 0.1; done
)");
  const uint64_t id = submit({s});
  const pid_t child = read_pid(work + "/child.pid", 20s);
  const pid_t grandchild = read_pid(work + "/grandchild.pid", 20s);
  ASSERT_GT(child, 0);
  ASSERT_GT(grandchild, 0);
  auto [rc, out] = client({"cancel", std::to_string(id)});
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(wait_job(id, [](const auto& j) { return j["state"] == "cancelled"; }, 20s))
      << job(id).dump(1);
  EXPECT_FALSE(pid_alive(child)) << "SIGKILL after the grace";
  EXPECT_FALSE(pid_alive(grandchild)) << "killed with its group";
}

TEST_F(ProgramJobs, AnAgentsDeathTakesItsProgramAlongAndTheJobIsRequeued) {
  auto& doomed = agent("doomed");
  const std::string s = script("forever.sh", R"(#!/bin/sh
echo $$ > "child-$LEASEHOLD_JOB_ATTEMPT.pid"
while true; do sleep 0.1; done
)");
  const uint64_t id = submit({s});
  const pid_t child = read_pid(work + "/child-1.pid", 20s);
  ASSERT_GT(child, 0);
  agent("heir");
  doomed.signal(SIGKILL);
  ASSERT_TRUE(doomed.wait(5s));
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (pid_alive(child) && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_FALSE(pid_alive(child)) << "the program outlived its agent";
  EXPECT_TRUE(wait_job(
      id, [](const auto& j) { return j["state"] == "running" && j["agent"] == "heir"; }, 30s))
      << job(id).dump(1);
  EXPECT_GT(read_pid(work + "/child-2.pid", 20s), 0) << "attempt 2 started it again";
  EXPECT_EQ(job(id)["attempt_history"][0]["outcome"], "agent lost");
  client({"cancel", std::to_string(id)});
  EXPECT_TRUE(wait_job(id, [](const auto& j) { return j["state"] == "cancelled"; }, 20s));
}

TEST_F(ProgramJobs, CtrlCOfRunCancelsTheJob) {
  agent("w1");
  std::vector<std::string> argv{bin_dir() + "/leasehold", "--endpoint", cluster.endpoint(), "run",
                                "--name", "loop", "--", "/bin/sh", "-c",
                                "echo started; while true; do sleep 0.1; done"};
  const auto cwd = fs::current_path();
  fs::current_path(work);
  Process runner(argv, work + "/run.log");
  fs::current_path(cwd);
  ASSERT_TRUE(runner.wait_for_log("started", 20s)) << runner.log();
  runner.signal(SIGINT);
  auto rc = runner.wait(30s);
  ASSERT_TRUE(rc) << runner.log();
  EXPECT_EQ(*rc, 130) << runner.log();
  EXPECT_NE(runner.log().find("cancelling job 1"), std::string::npos) << runner.log();
  EXPECT_EQ(job(1)["state"], "cancelled");
}

// A real PyTorch script (Debian's CPU PyTorch): trains, reports, succeeds.
TEST_F(ProgramJobs, APyTorchScriptTrainsAsAProgramJob) {
  if (std::system((std::string(kPython) + " -c 'import torch' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << "python3-torch is not installed";
  }
  agent("w1");
  script("train.py", R"(
import torch, leasehold
torch.manual_seed(0)
x = torch.randn(256, 8)
y = (x.sum(dim=1) > 0).long()
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.5)
for step in range(1, 101):
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    leasehold.report(step=step, epoch=1, loss=loss.item(), samples=256 * step)
acc = (model(x).argmax(dim=1) == y).float().mean().item()
leasehold.report(epoch=1, loss=loss.item(), test_accuracy=acc)
print("accuracy", acc)
)");
  auto [rc, out] = run({kPython, "train.py"}, {"--device", "auto"});
  EXPECT_EQ(rc, 0) << out;
  const auto j = job(1);
  ASSERT_EQ(j["epochs"].size(), 1u) << j.dump(1);
  EXPECT_GT(j["epochs"][0]["test_accuracy"].get<double>(), 0.9) << out;
  EXPECT_GT(j["progress"]["samples_per_second"].get<double>(), 0.0);
}

}  // namespace
}  // namespace leasehold::testing

namespace leasehold::testing {
namespace {

// How many times `text` is in `log`.
size_t count_in(const std::string& log, const std::string& text) {
  size_t n = 0;
  for (size_t at = log.find(text); at != std::string::npos; at = log.find(text, at + 1)) ++n;
  return n;
}

TEST_F(ProgramJobs, PythonScriptsRunWarmInAStandbyAndEverythingElseCold) {
  if (!fs::exists(kPython)) GTEST_SKIP() << kPython << " is missing";
  Process& w = cluster.start_agent("w1", {"--program-stop-grace", "1s", "--python-standby", "1",
                                          "--python-standby-python", kPython});
  auto ready = [&](size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + 120s;
    while (std::chrono::steady_clock::now() < deadline) {
      if (count_in(w.log(), "is ready after") >= n) return true;
      std::this_thread::sleep_for(50ms);
    }
    return false;
  };
  ASSERT_TRUE(ready(1)) << w.log();
  script("show.py", R"(
import os, sys, leasehold
leasehold.report(step=1, loss=0.5)
print("warm=%s argv=%s cwd=%s foo=%s name=%s job=%s" % (
    os.environ.get("LEASEHOLD_WARM"), sys.argv, os.getcwd(), os.environ.get("FOO"), __name__,
    leasehold.job().id))
sys.exit(int(os.environ.get("STATUS", "0")))
)");
  // A script, with its arguments, folder and environment.
  const std::string file = work + "/warm.json";
  std::ofstream(file) << nlohmann::json{
      {"name", "warm"},
      {"program",
       {{"command", {kPython, "show.py", "a", "b c"}},
        {"directory", work},
        {"environment", {{{"name", "FOO"}, {"value", "bar"}}, {{"name", "STATUS"}, {"value", "3"}}}}}}}
                             .dump();
  auto [src, sout] = client({"submit", file});
  ASSERT_EQ(src, 0) << sout;
  const uint64_t id = std::stoull(sout);
  ASSERT_TRUE(wait_job(id, [](const nlohmann::json& j) { return j["state"] == "failed"; }, 120s))
      << job(id).dump(1) << w.log();
  EXPECT_EQ(job(id)["exit_code"], 3);
  auto [lrc, log] = client({"logs", std::to_string(id)});
  EXPECT_EQ(log, "warm=process argv=['show.py', 'a', 'b c'] cwd=" + work +
                     " foo=bar name=__main__ job=" + std::to_string(id) + "\n")
      << w.log();
  EXPECT_EQ(job(id)["progress"]["step"], 1) << job(id).dump(1);
  EXPECT_TRUE(w.wait_for_log("runs warm in Python standby", 1s)) << w.log();

  // A module, once a new standby is ready.
  ASSERT_TRUE(ready(2)) << w.log();
  script("mod_x.py", "import sys, os\nprint('module', os.path.basename(sys.argv[0]), sys.argv[1:], "
                     "os.environ.get('LEASEHOLD_WARM'), __name__)\n");
  auto [mrc, mout] = run({kPython, "-m", "mod_x", "-v"});
  EXPECT_EQ(mrc, 0) << mout;
  EXPECT_NE(mout.find("module mod_x.py ['-v'] process __main__"), std::string::npos) << mout;

  // An uncaught exception: status 1 and its traceback's last line.
  ASSERT_TRUE(ready(3)) << w.log();
  script("boom.py", "def f():\n    raise ValueError('boom in the script')\nf()\n");
  auto [brc, bout] = run({kPython, "boom.py"});
  EXPECT_EQ(brc, 1) << bout;
  const auto failed = job(3);
  EXPECT_NE(failed["reason"].get<std::string>().find("ValueError: boom in the script"),
            std::string::npos)
      << failed.dump(1);
  EXPECT_EQ(count_in(w.log(), "runs warm in Python standby"), 3u) << w.log();

  // Interpreter options and start-up variables run cold, with the reason.
  ASSERT_TRUE(ready(4)) << w.log();
  auto [crc, cout] = run({kPython, "-u", "show.py"});
  EXPECT_EQ(crc, 0) << cout;
  EXPECT_NE(cout.find("warm=None"), std::string::npos) << cout;
  EXPECT_TRUE(w.wait_for_log("starts cold: it gives the interpreter options", 1s)) << w.log();
  EXPECT_EQ(count_in(w.log(), "runs warm in Python standby"), 3u) << w.log();
  // A missing script: Python's own words and status.
  auto [nrc, nout] = run({kPython, "missing.py"});
  EXPECT_EQ(nrc, 2) << nout;
  EXPECT_NE(nout.find("can't open file"), std::string::npos) << nout;
  EXPECT_EQ(count_in(w.log(), "runs warm in Python standby"), 4u) << w.log();
}

}  // namespace
}  // namespace leasehold::testing

namespace leasehold::testing {
namespace {

TEST_F(ProgramJobs, TwoPyTorchJobsOnTwoAgentsTrainOnOneDatasetRegion) {
  if (kSanitized) GTEST_SKIP() << "python3 cannot load the ASan-instrumented libleasehold.so";
  if (std::system((std::string(kPython) + " -c 'import torch' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << "python3-torch is not installed";
  }
  Process& w1 = agent("w1");
  Process& w2 = agent("w2");
  // Trains on the dataset (from the region, or built privately), prints its
  // losses, then holds on until the gate file exists.
  script("ds_train.py", R"(
import json, os, sys, time, torch, leasehold
from leasehold.torch import cached_dataset
mode, gate = sys.argv[1], sys.argv[2]
built = []
def build():
    built.append(True)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    return {"x": x, "y": (x[:, :4].sum(1) > 0).long()}
data = cached_dataset("toy/train", build) if mode == "region" else build()
x, y = data["x"], data["y"]
torch.manual_seed(1)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.2)
losses = []
for step in range(40):
    i = (step * 256) % 4096
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x[i:i + 256]), y[i:i + 256])
    loss.backward()
    opt.step()
    losses.append(loss.item())
    leasehold.report(step=step + 1, loss=loss.item())
print(json.dumps({"built": bool(built), "losses": losses}), flush=True)
while not os.path.exists(gate):
    time.sleep(0.05)
)");
  const std::string gate = work + "/gate";
  // Within budgets, the jobs leave the region its room in the pool.
  const std::string kBudget = R"({"memory_budget": "32MiB"})";
  auto result_of = [&](uint64_t id) -> nlohmann::json {
    auto [rc, log] = client({"logs", std::to_string(id)});
    const auto at = log.find("{\"built\"");
    if (rc != 0 || at == std::string::npos) return nullptr;
    return nlohmann::json::parse(log.substr(at, log.find('\n', at) - at), nullptr, false);
  };
  auto trained = [&](uint64_t id) {
    const auto deadline = std::chrono::steady_clock::now() + 120s;
    while (std::chrono::steady_clock::now() < deadline) {
      if (auto r = result_of(id); r.is_object()) return r;
      if (job(id)["state"] == "failed") break;
      std::this_thread::sleep_for(100ms);
    }
    return nlohmann::json();
  };
  // Private data first: the reference curve.
  std::ofstream(gate) << "open";
  const uint64_t alone = submit({kPython, "ds_train.py", "private", gate}, kBudget);
  const auto reference = trained(alone);
  ASSERT_TRUE(reference.is_object()) << job(alone).dump(1) << w1.log() << w2.log();
  ASSERT_TRUE(wait_job(alone, [](const auto& j) { return j["state"] == "succeeded"; }, 60s));
  fs::remove(gate);

  // Two jobs at once, each on its own agent, on one region.
  const uint64_t first = submit({kPython, "ds_train.py", "region", gate}, kBudget);
  const auto a = trained(first);
  ASSERT_TRUE(a.is_object()) << job(first).dump(1) << w1.log() << w2.log();
  const uint64_t second = submit({kPython, "ds_train.py", "region", gate}, kBudget);
  const auto b = trained(second);
  ASSERT_TRUE(b.is_object()) << job(second).dump(1) << w1.log() << w2.log();
  EXPECT_NE(job(first)["agent"], job(second)["agent"]);
  EXPECT_TRUE(a["built"].get<bool>());
  EXPECT_FALSE(b["built"].get<bool>()) << "the second job decoded nothing";
  EXPECT_EQ(a["losses"], reference["losses"]);
  EXPECT_EQ(b["losses"], reference["losses"]);
  auto [rrc, regions] = client({"regions", "-o", "json"});
  ASSERT_EQ(rrc, 0) << regions;
  const auto listed = nlohmann::json::parse(regions);
  ASSERT_EQ(listed["regions"].size(), 1u) << listed.dump(1);
  const auto& r = listed["regions"][0];
  EXPECT_EQ(r["name"], "datasets/toy/train");
  EXPECT_EQ(r["state"], "ready");
  EXPECT_EQ(r["refcount"], 2) << r.dump(1);
  EXPECT_EQ(r["hits"], 1) << r.dump(1);
  EXPECT_EQ(r["agents"].size(), 2u) << r.dump(1);

  std::ofstream(gate) << "open";
  for (uint64_t id : {first, second}) {
    EXPECT_TRUE(wait_job(id, [](const auto& j) { return j["state"] == "succeeded"; }, 60s))
        << job(id).dump(1);
  }
  // Detached when they ended; still resident for the next job.
  auto [rrc2, after] = client({"regions", "-o", "json"});
  const auto later = nlohmann::json::parse(after);
  ASSERT_EQ(later["regions"].size(), 1u) << after;
  EXPECT_EQ(later["regions"][0]["refcount"], 0) << after;
}

}  // namespace
}  // namespace leasehold::testing

namespace leasehold::testing {
namespace {

TEST_F(ProgramJobs, PublishedParametersStartTheNextPyTorchJobAndRegionsAreReadOnly) {
  if (kSanitized) GTEST_SKIP() << "python3 cannot load the ASan-instrumented libleasehold.so";
  if (std::system((std::string(kPython) + " -c 'import torch' 2>/dev/null").c_str()) != 0) {
    GTEST_SKIP() << "python3-torch is not installed";
  }
  agent("w1");
  const std::string budget = R"({"memory_budget": "32MiB"})";
  script("params.py", R"(
import sys, torch, leasehold
from leasehold.torch import publish_parameters, init_from, RegionError
def net(width, seed=None):
    torch.manual_seed(int(sys.argv[2]) if seed is None else seed)
    return torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
if sys.argv[1] == "publish":
    print("published", publish_parameters(net(16), "toy"))
elif sys.argv[1] == "init":
    m = net(16)
    print("initialized", init_from(m, "toy"))
    print("weight", float(m[0].weight.sum()))
    print("expected", float(net(16, 7)[0].weight.sum()))
    try:
        init_from(net(12), "toy")
    except RegionError as e:
        print("refused:", e)
else:
    x = leasehold.region("params/toy")
    print("writing", int(x[0]), flush=True)
    x[0] = 1  # read-only: this faults
    print("wrote")
)");
  const uint64_t pub = submit({kPython, "params.py", "publish", "7"}, budget);
  ASSERT_TRUE(wait_job(pub, [](const auto& j) { return j["state"] == "succeeded"; }, 120s))
      << job(pub).dump(1) << client({"logs", std::to_string(pub)}).second;
  const std::string published = client({"logs", std::to_string(pub)}).second;
  const auto digest = published.substr(published.find("published ") + 10, 16);

  const uint64_t init = submit({kPython, "params.py", "init", "1"}, budget);
  ASSERT_TRUE(wait_job(init, [](const auto& j) { return j["state"] == "succeeded"; }, 120s))
      << job(init).dump(1) << client({"logs", std::to_string(init)}).second;
  const std::string log = client({"logs", std::to_string(init)}).second;
  EXPECT_NE(log.find("initialized " + digest), std::string::npos) << log << published;
  // The seed-7 weights, not the seed-1 ones the module was built with.
  const auto weight = log.substr(log.find("weight ") + 7, log.find('\n', log.find("weight ")) -
                                                              log.find("weight ") - 7);
  EXPECT_NE(log.find("expected " + weight + "\n"), std::string::npos) << log;
  EXPECT_NE(log.find("refused: leasehold: region 'params/toy' does not fit the module: "
                     "0.weight: (16, 8) float32 in the region, (12, 8) float32 in the module"),
            std::string::npos)
      << log;

  // A write into a ready region faults in the writer alone.
  const uint64_t writer = submit({kPython, "params.py", "write", "0"}, budget);
  ASSERT_TRUE(wait_job(writer, [](const auto& j) { return j["state"] == "failed"; }, 120s))
      << job(writer).dump(1);
  EXPECT_EQ(job(writer)["exit_code"], 128 + SIGSEGV) << job(writer).dump(1);
  const std::string wlog = client({"logs", std::to_string(writer)}).second;
  EXPECT_NE(wlog.find("writing"), std::string::npos) << wlog;
  EXPECT_EQ(wlog.find("wrote"), std::string::npos) << wlog;
  // And the region is intact for the next job.
  const uint64_t again = submit({kPython, "params.py", "init", "2"}, budget);
  ASSERT_TRUE(wait_job(again, [](const auto& j) { return j["state"] == "succeeded"; }, 120s));
  EXPECT_NE(client({"logs", std::to_string(again)}).second.find("initialized " + digest),
            std::string::npos);
}

}  // namespace
}  // namespace leasehold::testing

namespace leasehold::testing {
namespace {

TEST_F(ProgramJobs, AJobInAForkStandbyHasItsGraceWhenCancelled) {
  if (!fs::exists(kPython)) GTEST_SKIP() << kPython << " is missing";
  Process& w = cluster.start_agent(
      "w1", {"--program-stop-grace", "20s", "--python-standby", "1", "--python-standby-mode",
             "fork", "--python-standby-python", kPython});
  ASSERT_TRUE(w.wait_for_log("is ready after", 120s)) << w.log();
  // Saves its work on SIGTERM, slowly, then ends.
  script("graceful.py", R"(
import os, signal, sys, time
def stop(*_):
    time.sleep(0.5)
    open("saved", "w").write(os.environ.get("LEASEHOLD_WARM", "cold"))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open("started", "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
)");
  const uint64_t id = submit({kPython, "graceful.py"});
  ASSERT_GT(read_pid(work + "/started", 60s), 0) << w.log();
  auto [rc, out] = client({"cancel", std::to_string(id)});
  EXPECT_EQ(rc, 0) << out;
  EXPECT_TRUE(wait_job(id, [](const auto& j) { return j["state"] == "cancelled"; }, 30s))
      << job(id).dump(1);
  std::string saved;
  std::ifstream(work + "/saved") >> saved;
  EXPECT_EQ(saved, "fork") << "the job ran warm and saved its work within its grace";
  EXPECT_TRUE(w.wait_for_log("runs warm in Python standby", 1s)) << w.log();
}

}  // namespace
}  // namespace leasehold::testing
