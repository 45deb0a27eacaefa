// leasehold-coordinator: allocates the pool once, leases it to agents, keeps
// the job queue in its store, and reports to systemd (Type=notify: READY,
// STATUS, WATCHDOG, STOPPING).
#include <systemd/sd-daemon.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <spdlog/spdlog.h>
#include <string>

#include "coordinator/broker.h"
#include "coordinator/options.h"
#include "shared/log.h"
#include "shared/signals.h"

int main(int argc, char** argv) {
  auto opts = leasehold::parse_coordinator_options(argc, argv);
  try {
    leasehold::init_logging(opts.log_level, "coordinator");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-coordinator: %s\n", e.what());
    return 2;
  }

  const std::atomic<bool>& stop = leasehold::install_stop_signals();

  try {
    leasehold::Broker broker(opts);
    sd_notifyf(0, "READY=1\nSTATUS=serving; %s", broker.summary().c_str());

    uint64_t watchdog_usec = 0;
    bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
    auto last_ping = std::chrono::steady_clock::now();
    std::string last_status;
    broker.run(stop, [&] {
      auto now = std::chrono::steady_clock::now();
      if (watchdog && now - last_ping > std::chrono::microseconds(watchdog_usec / 3)) {
        sd_notify(0, "WATCHDOG=1");
        last_ping = now;
      }
      std::string status = broker.summary();
      if (status != last_status) {
        sd_notifyf(0, "STATUS=serving; %s", status.c_str());
        last_status = status;
      }
    });
    sd_notify(0, "STOPPING=1\nSTATUS=stopping");
  } catch (const std::exception& e) {
    spdlog::critical("{}", e.what());
    sd_notifyf(0, "STATUS=failed: %s", e.what());
    return 1;
  }
  spdlog::info("stopped; pool freed");  // the Broker's destructor freed it
  return 0;
}
