#include "coordinator/lease_table.h"

#include <algorithm>

#include "shared/units.h"

namespace leasehold {

LeaseRecord LeaseTable::record(const LeaseOwner& owner, PoolAllocator::Block block,
                               PoolAllocator::End end) {
  LeaseRecord rec{next_id_, owner, block.offset, block.size, end, 1};
  next_id_ += id_stride_;
  leases_.emplace(rec.id, rec);
  return rec;
}

std::string LeaseTable::space_summary() const {
  return "free " + format_bytes(allocator_.free_bytes()) + ", largest free block " +
         format_bytes(allocator_.largest_free()) + ", pool " + format_bytes(allocator_.pool_size());
}

LeaseTable::RequestOutcome LeaseTable::request(const PendingRequest& req, bool may_wait,
                                               const Admit& admit) {
  if (req.size == 0) return Refusal{ErrorCode::InvalidArgument, "lease size must be positive"};
  if (!allocator_.could_ever_fit(req.size)) {
    return Refusal{ErrorCode::TooLarge, "a lease of " + format_bytes(req.size) + " (" +
                                            std::to_string(req.size) +
                                            " bytes) can never fit: the pool holds " +
                                            format_bytes(allocator_.pool_size())};
  }
  bool admitted = !admit || admit(req);
  if (admitted) {
    if (auto block = allocator_.allocate(req.size, req.end)) {
      return record(req.owner, *block, req.end);
    }
  }
  if (admitted && may_wait) {
    // Waiting helps only if someone else may give memory back. When the
    // requester's own leases are all that stand in the way (it holds the
    // rest of the pool, or nobody else holds anything and the free memory
    // is in pieces), it would wait for itself until its deadline: refuse
    // now, so it can give some back and ask again.
    const uint64_t own = leased_bytes(req.owner);
    const uint64_t others = allocator_.used_bytes() - own;
    if (req.size > allocator_.pool_size() - own || others == 0) {
      return Refusal{ErrorCode::NoSpace, "no room for a lease of " + format_bytes(req.size) +
                                             ": only " + req.owner.describe() + "'s own leases (" +
                                             format_bytes(own) + ") stand in the way (" +
                                             space_summary() + ")"};
    }
  }
  if (!may_wait) {
    if (!admitted) {
      return Refusal{ErrorCode::NoSpace, "a lease of " + format_bytes(req.size) +
                                             " is held back by the scheduling policy now (" +
                                             space_summary() + ")"};
    }
    return Refusal{ErrorCode::NoSpace, "no room for a lease of " + format_bytes(req.size) +
                                           " now (" + space_summary() + ")"};
  }
  waiting_.push_back(req);
  return Queued{};
}

std::variant<LeaseRecord, Refusal> LeaseTable::resize(const LeaseOwner& owner, uint64_t lease_id,
                                                      uint64_t size) {
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return Refusal{ErrorCode::NoSuchLease, "no lease with id " + std::to_string(lease_id)};
  }
  LeaseRecord& rec = it->second;
  if (rec.owner != owner) {
    return Refusal{ErrorCode::NotOwner,
                   "lease " + std::to_string(lease_id) + " belongs to " + rec.owner.describe()};
  }
  if (size == 0) return Refusal{ErrorCode::InvalidArgument, "lease size must be positive"};
  if (!allocator_.could_ever_fit(size)) {
    return Refusal{ErrorCode::TooLarge, "a lease of " + format_bytes(size) +
                                            " can never fit: the pool holds " +
                                            format_bytes(allocator_.pool_size())};
  }
  auto new_size = allocator_.resize(rec.offset, size);
  if (!new_size) {
    return Refusal{ErrorCode::NoSpace, "cannot grow lease " + std::to_string(lease_id) +
                                           " in place from " + format_bytes(rec.size) + " to " +
                                           format_bytes(size) + ": the range after it is in use (" +
                                           space_summary() + "); request a new lease instead"};
  }
  if (*new_size != rec.size) {
    rec.size = *new_size;
    ++rec.generation;
  }
  return rec;
}

std::optional<Refusal> LeaseTable::check_owner(const LeaseOwner& owner, uint64_t lease_id) const {
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) {
    return Refusal{ErrorCode::NoSuchLease, "no lease with id " + std::to_string(lease_id)};
  }
  if (it->second.owner != owner) {
    return Refusal{ErrorCode::NotOwner, "lease " + std::to_string(lease_id) + " belongs to " +
                                            it->second.owner.describe()};
  }
  return std::nullopt;
}

std::optional<Refusal> LeaseTable::release(const LeaseOwner& owner, uint64_t lease_id) {
  if (auto refusal = check_owner(owner, lease_id)) return refusal;
  auto it = leases_.find(lease_id);
  allocator_.free(it->second.offset);
  leases_.erase(it);
  return std::nullopt;
}

std::optional<Refusal> LeaseTable::hand_over(const LeaseOwner& owner, uint64_t lease_id,
                                             const LeaseOwner& to) {
  if (auto refusal = check_owner(owner, lease_id)) return refusal;
  leases_.at(lease_id).owner = to;
  return std::nullopt;
}

std::pair<size_t, uint64_t> LeaseTable::release_all(const LeaseOwner& owner) {
  size_t count = 0;
  uint64_t bytes = 0;
  for (auto it = leases_.begin(); it != leases_.end();) {
    if (it->second.owner == owner) {
      allocator_.free(it->second.offset);
      bytes += it->second.size;
      ++count;
      it = leases_.erase(it);
    } else {
      ++it;
    }
  }
  std::erase_if(waiting_, [&](const PendingRequest& r) { return r.owner == owner; });
  return {count, bytes};
}

std::pair<size_t, uint64_t> LeaseTable::transfer_all(const LeaseOwner& from, const LeaseOwner& to) {
  size_t count = 0;
  uint64_t bytes = 0;
  for (auto& [id, rec] : leases_) {
    if (rec.owner == from) {
      rec.owner = to;
      bytes += rec.size;
      ++count;
    }
  }
  std::erase_if(waiting_, [&](const PendingRequest& r) { return r.owner == from; });
  return {count, bytes};
}

bool LeaseTable::reassign(uint64_t lease_id, const LeaseOwner& owner) {
  auto it = leases_.find(lease_id);
  if (it == leases_.end()) return false;
  it->second.owner = owner;
  return true;
}

std::vector<GrantedLater> LeaseTable::grant_waiting(const Admit& admit) {
  std::vector<GrantedLater> out;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (admit && !admit(*it)) {
      ++it;
      continue;
    }
    if (auto block = allocator_.allocate(it->size, it->end)) {
      out.push_back({it->reply_to, record(it->owner, *block, it->end), it->since});
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::vector<Expired> LeaseTable::expire(Clock::time_point now) {
  std::vector<Expired> out;
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    if (it->deadline <= now) {
      out.push_back(
          {it->reply_to, Refusal{ErrorCode::Timeout, "lease of " + format_bytes(it->size) +
                                                         " was not granted before its deadline (" +
                                                         space_summary() + ")"}});
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

std::optional<Clock::time_point> LeaseTable::next_deadline() const {
  std::optional<Clock::time_point> best;
  for (const auto& r : waiting_) {
    if (!best || r.deadline < *best) best = r.deadline;
  }
  return best;
}

uint64_t LeaseTable::leased_bytes(const LeaseOwner& owner) const {
  uint64_t total = 0;
  for (const auto& [id, rec] : leases_) {
    if (rec.owner == owner) total += rec.size;
  }
  return total;
}

size_t LeaseTable::lease_count(const LeaseOwner& owner) const {
  size_t n = 0;
  for (const auto& [id, rec] : leases_) n += rec.owner == owner;
  return n;
}

}  // namespace leasehold
