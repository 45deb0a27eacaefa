#include "agent/exercise.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

#include "agent/lease_memory.h"

namespace leasehold {
namespace {

struct Held {
  Lease lease;
  uint64_t seed = 0;
};

// Alternates the ends of the pool, to exercise both allocation directions.
std::vector<Held> acquire_all(AgentSession& session, const ExerciseOptions& opts,
                              uint64_t base_seed) {
  std::vector<Held> held;
  for (int i = 0; i < opts.leases; ++i) {
    Held h;
    h.lease = session.acquire(opts.lease_size, i % 2 ? LeaseEnd::High : LeaseEnd::Low);
    h.seed = base_seed ^ (h.lease.id() * 0x100000001B3ull);
    fill_lease_pattern(h.lease, h.seed);
    std::printf("leased id=%llu offset=%llu size=%llu\n",
                static_cast<unsigned long long>(h.lease.id()),
                static_cast<unsigned long long>(h.lease.offset()),
                static_cast<unsigned long long>(h.lease.size()));
    held.push_back(std::move(h));
  }
  std::fflush(stdout);
  return held;
}

}  // namespace

int run_exercise(AgentSession& session, const ExerciseOptions& opts,
                 const std::atomic<bool>& stop) {
  const uint64_t base_seed = std::hash<std::string>{}(session.name());
  std::vector<Held> held;
  for (int round = 1; !stop.load() && (opts.rounds == 0 || round <= opts.rounds);) {
    try {
      if (held.empty()) {
        held = acquire_all(session, opts, base_seed + round);
        if (opts.stray_write_offset) {
          std::printf("test: writing %llu bytes at pool offset %llu, outside this agent's leases\n",
                      static_cast<unsigned long long>(opts.stray_write_bytes),
                      static_cast<unsigned long long>(*opts.stray_write_offset));
          std::fflush(stdout);
          const PoolDescriptor pool = session.pool();
          try {
            fill_pool_pattern(pool.backend, pool.device,
                              session.pool_base() + *opts.stray_write_offset,
                              opts.stray_write_bytes, 0x5eed);
          } catch (const std::exception& e) {
            // On CUDA the fault ends this process's context; reported here
            // rather than as a device fault to restart from.
            std::printf("test: the stray write faulted in this agent: %s\n", e.what());
            std::fflush(stdout);
            return 4;
          }
          std::printf("test: the stray write went through\n");
          std::fflush(stdout);
        }
      }
      std::this_thread::sleep_for(opts.interval);
      // The self-fence (lease_client/session.h): no lease is touched while the
      // coordinator may have fenced them.
      if (session.connected() && !session.may_touch()) {
        std::printf("paused: the coordinator is silent; touching no lease\n");
        std::fflush(stdout);
        session.wait_may_touch([&] { return stop.load(); });
      }
      bool lost = false;
      uint64_t bytes = 0;
      for (auto& h : held) {
        if (h.lease.lost()) {
          lost = true;
          break;
        }
        size_t bad = count_lease_mismatches(h.lease, h.seed);
        if (bad) {
          std::printf("CORRUPTION lease=%llu offset=%llu words=%zu\n",
                      static_cast<unsigned long long>(h.lease.id()),
                      static_cast<unsigned long long>(h.lease.offset()), bad);
          std::fflush(stdout);
          spdlog::error("lease {}: {} words changed under us", h.lease.id(), bad);
          return 3;
        }
        // Write a new pattern each round so neighbours keep writing too.
        h.seed = h.seed * 6364136223846793005ull + 1442695040888963407ull;
        fill_lease_pattern(h.lease, h.seed);
        bytes += h.lease.size();
      }
      if (lost) {
        std::printf("leases lost; acquiring again\n");
        std::fflush(stdout);
        held.clear();
        session.wait_connected(std::chrono::seconds(1));  // the loop re-checks `stop`
        continue;
      }
      std::printf("verified round=%d leases=%zu bytes=%llu\n", round, held.size(),
                  static_cast<unsigned long long>(bytes));
      std::fflush(stdout);
      ++round;
      if (opts.churn) {
        for (auto& h : held) session.release(h.lease);
        held.clear();
      }
    } catch (const Error& e) {
      // Session lost mid-request, or between the lost() check and touching
      // a lease (the coordinator stopped just then): wait for
      // re-registration and start over.
      const bool lease_lost =
          std::any_of(held.begin(), held.end(), [](const Held& h) { return h.lease.lost(); });
      if (e.code() != ErrorCode::UnknownSender && e.code() != ErrorCode::Timeout && !lease_lost) {
        throw;
      }
      spdlog::warn("{}; retrying", e.what());
      held.clear();
      session.wait_connected(std::chrono::seconds(1));
    }
  }
  for (auto& h : held) session.release(h.lease);
  std::printf("exercise passed\n");
  std::fflush(stdout);
  return 0;
}

}  // namespace leasehold
