// The coordinator's lease table: who holds which range of the pool, and the
// requests waiting for memory. Pure bookkeeping over a PoolAllocator: no
// sockets, no clocks of its own (callers pass `now`), so it is tested alone.
//
// Waiting requests are served first-come first-served, but a request that
// does not fit yet does not block smaller ones behind it from being granted
// (no head-of-line blocking); each has a deadline after which it fails.
//
// Thread safety: none; the coordinator's loop owns it.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "coordinator/lease_owner.h"
#include "shared/error.h"
#include "shared/pool_allocator.h"

namespace leasehold {

using Clock = std::chrono::steady_clock;

struct LeaseRecord {
  uint64_t id = 0;
  LeaseOwner owner;
  uint64_t offset = 0;
  uint64_t size = 0;
  PoolAllocator::End end = PoolAllocator::End::Low;
  uint64_t generation = 0;
};

// Where to send the answer to a request that waited.
struct ReplyTo {
  std::string routing_id;
  uint64_t request_id = 0;
};

struct PendingRequest {
  LeaseOwner owner;
  uint64_t size = 0;
  PoolAllocator::End end = PoolAllocator::End::Low;
  Clock::time_point deadline;
  ReplyTo reply_to;
  Clock::time_point since{};  // when it was asked (time spent waiting for memory)
  bool needed = false;        // the job cannot go on without it (nothing left to spill)
};

struct Refusal {
  ErrorCode code;
  std::string message;
};

// A waiting request that was granted, or one whose deadline passed.
struct GrantedLater {
  ReplyTo reply_to;
  LeaseRecord lease;
  Clock::time_point since;  // when it was asked
};
struct Expired {
  ReplyTo reply_to;
  Refusal refusal;
};

class LeaseTable {
 public:
  // Lease ids are unique across the tables of one coordinator (one per
  // device): table `id_offset` of `id_stride` hands out offset+1,
  // offset+1+stride, ... (1, 2, 3, ... for a single table).
  LeaseTable(uint64_t pool_size, uint64_t alignment, uint64_t id_stride = 1, uint64_t id_offset = 0)
      : allocator_(pool_size, alignment), next_id_(id_offset + 1), id_stride_(id_stride) {}

  struct Queued {};
  using RequestOutcome = std::variant<LeaseRecord, Queued, Refusal>;
  // The scheduling policy's say: whether a request may be granted now
  // (empty: always). A request it holds back is treated as not fitting.
  using Admit = std::function<bool(const PendingRequest&)>;

  // Grants at once when the request fits and `admit` allows it; otherwise
  // queues it until `deadline`, or refuses with NoSpace when `may_wait` is
  // false. A size of 0 is InvalidArgument; one larger than the pool is
  // TooLarge at once.
  RequestOutcome request(const PendingRequest& req, bool may_wait, const Admit& admit = {});

  // Only the owner may resize or release. Errors: NoSuchLease, NotOwner,
  // InvalidArgument (size 0), TooLarge, NoSpace (cannot grow in place).
  std::variant<LeaseRecord, Refusal> resize(const LeaseOwner& owner, uint64_t lease_id,
                                            uint64_t size);
  std::optional<Refusal> release(const LeaseOwner& owner, uint64_t lease_id);
  // Gives lease `lease_id` of `owner` to `to` (memory held back, as
  // transfer_all), with release's checks and errors.
  std::optional<Refusal> hand_over(const LeaseOwner& owner, uint64_t lease_id,
                                   const LeaseOwner& to);

  // Releases every lease of `owner` and drops its waiting requests. Returns
  // the number of leases and bytes reclaimed.
  std::pair<size_t, uint64_t> release_all(const LeaseOwner& owner);
  // Gives every lease of `from` to `to` (nobody may use them; they are held
  // back until released) and drops the waiting requests of `from`. Returns
  // the number of leases and bytes moved.
  std::pair<size_t, uint64_t> transfer_all(const LeaseOwner& from, const LeaseOwner& to);

  // Gives lease `lease_id` to `owner` (a filling region's memory goes to
  // the agent that was filling it, to be released or fenced with its own).
  // False when there is no such lease.
  bool reassign(uint64_t lease_id, const LeaseOwner& owner);

  // Grants waiting requests that fit now and `admit` allows, in queue
  // order. Call after anything that frees memory.
  std::vector<GrantedLater> grant_waiting(const Admit& admit = {});
  // Removes and returns waiting requests whose deadline is at or before `now`.
  std::vector<Expired> expire(Clock::time_point now);
  std::optional<Clock::time_point> next_deadline() const;
  // Moves every waiting request's deadline on by `gap` (the coordinator
  // did not run for that long: CoordinatorCore::stalled).
  void postpone_deadlines(Clock::duration gap) {
    for (auto& w : waiting_) w.deadline += gap;
  }

  const std::map<uint64_t, LeaseRecord>& leases() const { return leases_; }
  size_t waiting() const { return waiting_.size(); }
  const std::deque<PendingRequest>& waiting_requests() const { return waiting_; }
  uint64_t leased_bytes(const LeaseOwner& owner) const;
  size_t lease_count(const LeaseOwner& owner) const;
  const PoolAllocator& allocator() const { return allocator_; }

 private:
  LeaseRecord record(const LeaseOwner& owner, PoolAllocator::Block block, PoolAllocator::End end);
  // NoSuchLease or NotOwner, as release says them; nullopt: `owner`'s.
  std::optional<Refusal> check_owner(const LeaseOwner& owner, uint64_t lease_id) const;
  std::string space_summary() const;

  PoolAllocator allocator_;
  std::map<uint64_t, LeaseRecord> leases_;
  std::deque<PendingRequest> waiting_;
  uint64_t next_id_;
  uint64_t id_stride_;
};

}  // namespace leasehold
