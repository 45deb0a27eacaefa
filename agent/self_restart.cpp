#include "agent/self_restart.h"

#include <spawn.h>
#include <spdlog/spdlog.h>
#include <sys/wait.h>
#include <unistd.h>
#include <linux/close_range.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>
#include <vector>

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

extern char** environ;

namespace leasehold {
namespace {
constexpr const char* kRestartsEnv = "LEASEHOLD_AGENT_RESTARTS";
constexpr const char* kDeviceEnv = "LEASEHOLD_AGENT_GPU";
}  // namespace

int self_restarts() {
  const char* v = std::getenv(kRestartsEnv);
  return v ? std::atoi(v) : 0;
}

void reset_self_restarts() { ::unsetenv(kRestartsEnv); }

int restart_device() {
  const char* v = std::getenv(kDeviceEnv);
  return v ? std::max(0, std::atoi(v)) : 0;
}

std::string restart_self(char** argv, int device) {
  ::setenv(kRestartsEnv, std::to_string(self_restarts() + 1).c_str(), 1);
  ::setenv(kDeviceEnv, std::to_string(device).c_str(), 1);
  spdlog::default_logger()->flush();
  std::fflush(nullptr);
  // Descriptors opened by libraries without close-on-exec (the driver's,
  // the MPS client connection) must not outlive this image.
  ::close_range(3, ~0U, CLOSE_RANGE_CLOEXEC);
  ::execv("/proc/self/exe", argv);
  return std::string("cannot run /proc/self/exe again: ") + std::strerror(errno);
}

int probe_cuda_context(int device) {
#ifdef LEASEHOLD_HAVE_CUDA
  cudaError_t err = cudaSetDevice(device);
  if (err == cudaSuccess) err = cudaFree(nullptr);  // creates the context
  if (err == cudaSuccess) return 0;
  if (err == cudaErrorMpsServerNotReady) return kProbeNotReady;
  std::fprintf(stderr, "CUDA context on device %d: %s (%s)\n", device, cudaGetErrorName(err),
               cudaGetErrorString(err));
  return 1;
#else
  std::fprintf(stderr, "this build has no CUDA (device %d)\n", device);
  return 1;
#endif
}

void wait_for_cuda_context(const std::string& program, int device,
                           std::chrono::milliseconds limit, const std::atomic<bool>& stop) {
  const auto start = std::chrono::steady_clock::now();
  const std::string dev = std::to_string(device);
  std::vector<char*> args{const_cast<char*>(program.c_str()),
                          const_cast<char*>("--probe-cuda-context"),
                          const_cast<char*>(dev.c_str()), nullptr};
  bool said = false;
  while (!stop.load()) {
    pid_t pid = 0;
    int rc = ::posix_spawn(&pid, program.c_str(), nullptr, nullptr, args.data(), environ);
    if (rc != 0) {
      spdlog::warn("cannot run {} to probe the GPU: {}", program, std::strerror(rc));
      return;
    }
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    const auto waited = std::chrono::steady_clock::now() - start;
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(waited).count();
    if (code == 0) {
      if (said) spdlog::info("the GPU takes new work again after {} ms", ms);
      return;
    }
    if (code != kProbeNotReady) return;  // the agent's own first call says what
    if (waited > limit) {
      throw std::runtime_error("the MPS server still does not take new clients after " +
                               std::to_string(ms) +
                               " ms (it waits for every client of the faulted context to exit; "
                               "see its server.log)");
    }
    if (!said) {
      spdlog::warn("the MPS server is recovering from a fault (it takes new clients once every "
                   "old one has exited); waiting");
      said = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

}  // namespace leasehold
