// leasehold-coordinator: allocates the pool once, leases it to agents, keeps
// the job queue in its store, and reports to systemd (Type=notify: READY,
// STATUS, WATCHDOG, STOPPING).
#include <signal.h>
#include <sys/prctl.h>
#include <spdlog/spdlog.h>
#include <systemd/sd-daemon.h>

#include <atomic>
#include <cstdio>
#include <exception>
#include <string>
#include <thread>

#include "coordinator/broker.h"
#include "coordinator/options.h"
#include "shared/log.h"
#include "shared/signals.h"

namespace {

// The hidden --test-stall-on-sigusr1 hook: the handler only sets a flag;
// the loop's own tick sleeps, as a loop stuck in real work would.
std::atomic<bool> g_stall_requested{false};
void request_stall(int) { g_stall_requested.store(true); }

}  // namespace

int main(int argc, char** argv) {
  auto opts = leasehold::parse_coordinator_options(argc, argv);
  try {
    leasehold::init_logging(opts.log_level, "coordinator");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "leasehold-coordinator: %s\n", e.what());
    return 2;
  }

  // Every chunk of every pool is a descriptor of this process: nobody may
  // take them through /proc/PID/fd or ptrace, not even processes of our
  // own user (agents usually are). No core dumps either, which would hold
  // no pool memory anyway.
  if (::prctl(PR_SET_DUMPABLE, 0) != 0) {
    std::fprintf(stderr, "leasehold-coordinator: cannot make the process non-dumpable\n");
    return 1;
  }

  const std::atomic<bool>& stop = leasehold::install_stop_signals();
  if (opts.test_stall_on_sigusr1.count() > 0) {
    struct sigaction sa {};
    sa.sa_handler = request_stall;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGUSR1, &sa, nullptr);
  }

  try {
    leasehold::Broker broker(opts);
    std::string last_status = broker.summary();
    sd_notifyf(0, "READY=1\nSTATUS=serving; %s", last_status.c_str());

    uint64_t watchdog_usec = 0;
    bool watchdog = sd_watchdog_enabled(0, &watchdog_usec) > 0;
    auto last_ping = std::chrono::steady_clock::now();
    // The watchdog is pinged from the loop's own tick, never from another
    // thread: a loop that stops turning stops the pings, and systemd
    // restarts the service.
    broker.run(stop, [&] {
      if (g_stall_requested.exchange(false)) {
        spdlog::warn("test hook: stalling the loop for {} ms", opts.test_stall_on_sigusr1.count());
        std::this_thread::sleep_for(opts.test_stall_on_sigusr1);
      }
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
