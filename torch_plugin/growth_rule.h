// How a job's lease requests follow the occupancy policy's growth rules,
// as the agent's engine jobs do (agent/memory/leased_pages.h), for the
// plug-in's lease source (session_leases.h):
//
// - Within the job's guaranteed share (memory_min) a lease may wait while
//   the policy makes room: the coordinator's default wait.
// - Past it, growth is opportunistic: asked for without waiting and, once
//   refused for want of space, not asked for again for kBackoff, so that
//   the allocation goes to the pressure handler (spilling) at once rather
//   than after the coordinator's lease wait.
// - Only a last-resort request (the cache has nothing more to give back)
//   made while the caller says nothing is left to spill is needed: it
//   waits, and the policy may have others shrink for it. With no share
//   known every last resort is needed, as before shares existed.
//
// Pure: the caller passes the bytes leased now and the time, and keeps it
// under its own lock.
#pragma once

#include <chrono>
#include <cstdint>

namespace leasehold::torch_plugin {

class GrowthRule {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kBackoff{1000};

  // `guaranteed`: the job's share in bytes (0: none known).
  explicit GrowthRule(uint64_t guaranteed) : guaranteed_(guaranteed) {}

  struct Ask {
    bool growth = false;     // past the share, not needed
    bool needed = false;     // LeaseRequest.needed
    bool held_back = false;  // growth refused less than kBackoff ago: do not ask
    int64_t wait_ms = -1;    // -1: the coordinator's default; 0: not at all
  };

  // What to ask for a lease of `bytes` while `leased` are held
  // (`leased_known` false: the session could not say; that counts as
  // within the share). `last_resort`: the cache has nothing more to give
  // back; `nothing_to_spill`: the pressure handler freed nothing.
  Ask ask(uint64_t leased, bool leased_known, uint64_t bytes, bool last_resort,
          bool nothing_to_spill, Clock::time_point now) const;
  // The coordinator answered `a` with no space: growth waits kBackoff.
  void refused_for_space(const Ask& a, Clock::time_point now);

  uint64_t guaranteed() const { return guaranteed_; }

 private:
  const uint64_t guaranteed_;
  Clock::time_point no_growth_until_{};
};

}  // namespace leasehold::torch_plugin
