// Python standbys' pieces without an agent: which job commands run warm
// (agent/python_standby.h), and a started program's control pipe
// (agent/program_process.h) carrying a job line to a program that was
// started before it.
#include <gtest/gtest.h>
#include <unistd.h>

#include "agent/program_process.h"
#include "agent/python_standby.h"
#include "shared/process.h"

namespace leasehold {
namespace {

const std::string kPy = "/usr/bin/python3";

// Running (a zombie waiting for its reaper has ended).
bool alive(pid_t pid) {
  auto state = process_state(pid);
  return state && *state != 'Z' && *state != 'X';
}

TEST(PythonStandby, ScriptsAndModulesOfTheStandbysInterpreterRunWarm) {
  std::string why;
  auto script = warm_command({"python3", "train.py", "--steps", "3"}, kPy, kPy, {"FOO"}, why);
  ASSERT_TRUE(script) << why;
  EXPECT_EQ(script->argv, (std::vector<std::string>{"train.py", "--steps", "3"}));
  EXPECT_FALSE(script->module);
  auto module = warm_command({kPy, "-m", "pkg.train", "-x"}, kPy, kPy, {}, why);
  ASSERT_TRUE(module) << why;
  EXPECT_EQ(*module->module, "pkg.train");
  EXPECT_EQ(module->argv, (std::vector<std::string>{"pkg.train", "-x"}));
}

TEST(PythonStandby, EverythingElseRunsColdWithItsReason) {
  std::string why;
  EXPECT_FALSE(warm_command({"python3", "t.py"}, kPy, "", {}, why));
  EXPECT_NE(why.find("no Python standbys"), std::string::npos) << why;
  EXPECT_FALSE(warm_command({"python3.9", "t.py"}, "/usr/bin/python3.9", kPy, {}, why));
  EXPECT_NE(why.find("interpreter"), std::string::npos) << why;
  EXPECT_FALSE(warm_command({"sh", "t.sh"}, "/bin/sh", kPy, {}, why));
  EXPECT_FALSE(warm_command({"python3", "-u", "t.py"}, kPy, kPy, {}, why));
  EXPECT_NE(why.find("options"), std::string::npos) << why;
  EXPECT_FALSE(warm_command({"python3"}, kPy, kPy, {}, why));
  EXPECT_FALSE(warm_command({"python3", "-m"}, kPy, kPy, {}, why));
  EXPECT_FALSE(warm_command({"python3", "-m", "-x"}, kPy, kPy, {}, why));
  EXPECT_FALSE(warm_command({"python3", "-c", "print(1)"}, kPy, kPy, {}, why));
  for (const char* name : {"PYTHONHASHSEED", "LD_PRELOAD", "CUDA_LAUNCH_BLOCKING",
                           "TORCH_HOME", "PYTORCH_CUDA_ALLOC_CONF", "NCCL_DEBUG",
                           "OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUBLAS_WORKSPACE_CONFIG"}) {
    EXPECT_FALSE(warm_command({"python3", "t.py"}, kPy, kPy, {"A", name}, why)) << name;
    EXPECT_NE(why.find(name), std::string::npos) << why;
  }
  EXPECT_FALSE(startup_variable("DATA_DIR"));
  EXPECT_FALSE(startup_variable("WANDB_MODE"));
  for (const char* name : {"HOME", "LANG", "LC_ALL", "TMPDIR", "HF_HOME", "XDG_CACHE_HOME"}) {
    EXPECT_TRUE(startup_variable(name)) << name;
  }
}

TEST(ProgramChildren, AProgramReadsItsJobFromTheControlPipeAndIsSupervisedAfterwards) {
  ProgramLaunch launch;
  launch.exe = "/bin/sh";
  launch.dir = "/";
  launch.argv = {"sh", "-c", "echo warm; read line <&4; echo \"got $line\"; echo '{\"type\":"
                             "\"report\",\"step\":7}' >&3; exit 5"};
  launch.env = {"PATH=/usr/bin:/bin"};
  launch.control_pipe = true;
  ProgramChild child = start_program(launch);
  ASSERT_TRUE(child);
  ASSERT_GE(child.control_fd(), 0);
  const std::string line = "job-1\n";
  ASSERT_EQ(::write(child.control_fd(), line.data(), line.size()),
            static_cast<ssize_t>(line.size()));
  child.close_control();
  ProgramRun run;
  std::string output;
  int64_t step = 0;
  run.on_output = [&](std::string_view chunk, uint64_t) { output += chunk; };
  run.on_report = [&](const ProgramReport& r) { step = r.step.value_or(0); };
  const ProgramOutcome out = supervise(child, run);
  EXPECT_EQ(out.exit_code, 5);
  EXPECT_EQ(output, "warm\ngot job-1\n");
  EXPECT_EQ(step, 7);
}

TEST(ProgramChildren, ADroppedChildIsKilledWithItsGroupAndReaped) {
  ProgramLaunch launch;
  launch.exe = "/bin/sh";
  launch.dir = "/";
  launch.argv = {"sh", "-c", "sleep 1000 & echo $! >&3; wait"};
  launch.env = {"PATH=/usr/bin:/bin"};
  pid_t grandchild = 0, pid = 0;
  {
    ProgramChild child = start_program(launch);
    pid = child.pid();
    std::string text;
    char buf[64];
    while (text.find('\n') == std::string::npos) {
      const ssize_t n = ::read(child.report_fd(), buf, sizeof buf);
      if (n > 0) text.append(buf, static_cast<size_t>(n));
      if (n == 0) break;
      if (n < 0) ::usleep(10000);
    }
    grandchild = std::stoi(text);
    EXPECT_FALSE(child.exited());
  }
  EXPECT_NE(::kill(pid, 0), 0);  // reaped: no such process
  for (int i = 0; i < 500 && alive(grandchild); ++i) ::usleep(10000);
  EXPECT_FALSE(alive(grandchild));  // its group went with it
}

}  // namespace
}  // namespace leasehold
