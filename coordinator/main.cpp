// leasehold-coordinator: allocates the pool once, leases it to agents, and
// reports to systemd (Type=notify: READY, STATUS, WATCHDOG, STOPPING).
#include <signal.h>
#include <systemd/sd-daemon.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <spdlog/spdlog.h>
#include <string>

#include "coordinator/coordinator.h"
#include "coordinator/options.h"
#include "shared/log.h"

namespace {
std::atomic<bool> g_stop{false};
extern "C" void on_signal(int) { g_stop.store(true); }
}  // namespace

int main(int argc, char** argv) {
  auto opts = leasehold::parse_coordinator_options(argc, argv);
  try {
    leasehold::init_logging(opts.log_level, "coordinator");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-coordinator: %s\n", e.what());
    return 2;
  }

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);

  try {
    leasehold::Coordinator coordinator(opts);
    sd_notifyf(0, "READY=1\nSTATUS=serving; %s", coordinator.summary().c_str());

    uint64_t watchdog_usec = 0;
    bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
    auto last_ping = std::chrono::steady_clock::now();
    std::string last_status;
    coordinator.run(g_stop, [&] {
      auto now = std::chrono::steady_clock::now();
      if (watchdog && now - last_ping > std::chrono::microseconds(watchdog_usec / 3)) {
        sd_notify(0, "WATCHDOG=1");
        last_ping = now;
      }
      std::string status = coordinator.summary();
      if (status != last_status) {
        sd_notifyf(0, "STATUS=serving; %s", status.c_str());
        last_status = status;
      }
    });
    sd_notify(0, "STOPPING=1\nSTATUS=stopping");
    spdlog::info("stopped; pool freed");
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    sd_notifyf(0, "STATUS=failed: %s", e.what());
    return 1;
  }
  return 0;
}
