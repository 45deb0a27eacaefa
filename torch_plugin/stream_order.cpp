#include "torch_plugin/stream_order.h"

#include <iterator>
#include <set>

namespace leasehold::torch_plugin::detail {

// ---- events on several streams at once -------------------------------------------

void destroy_all(StreamOps& streams, const std::vector<Recorded>& evs) {
  for (const auto& r : evs) streams.destroy(r.event);
}

std::vector<Recorded> record_each(StreamOps& streams, const std::vector<StreamId>& targets) {
  std::vector<Recorded> evs;
  evs.reserve(targets.size());
  try {
    for (StreamId s : targets) evs.push_back({s, streams.record(s)});
  } catch (...) {
    destroy_all(streams, evs);
    throw;
  }
  return evs;
}

void wait_unlocked(std::unique_lock<std::mutex>& lk, StreamOps& streams,
                   const std::vector<Recorded>& evs) {
  lk.unlock();
  try {
    for (const auto& r : evs) streams.wait(r.event);
  } catch (...) {
    lk.lock();
    throw;
  }
  lk.lock();
}

void reach_now(std::unique_lock<std::mutex>& lk, StreamOps& streams,
               const std::vector<StreamId>& targets) {
  const std::vector<Recorded> evs = record_each(streams, targets);
  try {
    wait_unlocked(lk, streams, evs);
  } catch (...) {
    destroy_all(streams, evs);
    throw;
  }
  destroy_all(streams, evs);
}

// ---- the cache's events ---------------------------------------------------------

void StreamOrder::complete(StreamId s, const Pending& done) {
  if (done.block == nullptr) {
    migrating_.erase(s);
    pool_.promote(s, done.watermark);
  } else if (--done.block->pending == 0) {
    pool_.make_free(done.block, false);
  }
}

void StreamOrder::process_events() {
  for (auto it = pending_.begin(); it != pending_.end();) {
    auto& q = it->second;
    while (!q.empty() && streams_.query(q.front().event)) {
      Pending done = q.front();
      q.pop_front();
      --pending_events_;
      streams_.destroy(done.event);
      complete(it->first, done);
    }
    it = q.empty() ? pending_.erase(it) : std::next(it);
  }
}

bool StreamOrder::start_migrations(bool small, uint64_t size, StreamId stream) {
  std::vector<StreamId> targets;
  for (StreamId s : pool_.owners_of(small, size)) {
    if (s == stream || migrating_.count(s)) continue;
    if (!streams_.capturing(s)) targets.push_back(s);
  }
  if (targets.empty()) return false;
  for (const auto& r : record_each(streams_, targets)) {
    pending_[r.stream].push_back({r.event, nullptr, free_seq_});
    ++pending_events_;
    migrating_.insert(r.stream);
  }
  return true;
}

bool StreamOrder::drain(std::unique_lock<std::mutex>& lk, bool small, StreamId stream) {
  std::set<StreamId> wanted;
  for (StreamId s : pool_.owners(small)) {
    if (s != stream) wanted.insert(s);
  }
  return reach(lk, std::move(wanted));
}

bool StreamOrder::drain_all(std::unique_lock<std::mutex>& lk) {
  std::set<StreamId> wanted;
  for (bool small : {false, true}) {
    for (StreamId s : pool_.owners(small)) wanted.insert(s);
  }
  return reach(lk, std::move(wanted));
}

bool StreamOrder::reach(std::unique_lock<std::mutex>& lk, std::set<StreamId> wanted) {
  for (auto& [s, q] : pending_) wanted.insert(s);
  std::vector<StreamId> targets;
  for (StreamId s : wanted) {
    if (!streams_.capturing(s)) targets.push_back(s);
  }
  if (targets.empty()) return false;
  uint64_t watermark = free_seq_;
  reach_now(lk, streams_, targets);
  for (StreamId s : targets) pool_.promote(s, watermark);
  // Events queued on those streams before ours completed too.
  process_events();
  return true;
}

void StreamOrder::await_users(Block* b, const std::vector<StreamId>& uses) {
  std::vector<Recorded> evs = record_each(streams_, uses);
  for (const auto& r : evs) {
    pending_[r.stream].push_back({r.event, b, 0});
    ++pending_events_;
  }
  b->state = BState::kWaiting;
  b->pending = static_cast<int>(evs.size());
  b->uses.clear();
}

void StreamOrder::abandon_events() noexcept {
  for (auto& [stream, q] : pending_) {
    for (const auto& p : q) streams_.destroy(p.event);
  }
}

bool StreamOrder::pending_count_consistent() const {
  size_t queued = 0;
  for (const auto& [s, q] : pending_) queued += q.size();
  return queued == pending_events_;
}

}  // namespace leasehold::torch_plugin::detail
