// Stream order (internal to the block cache: block_cache.h states the
// rules): when a freed block becomes reusable by streams other than the one
// that freed it, learnt from events on single streams, never by waiting for
// a whole device.
//
// Two kinds of event are outstanding, queued per stream in record order so
// that only the oldest of each stream needs asking:
// - a record_stream user's, recorded when the block is freed; the block
//   stays kWaiting (reused by no stream) until every user's completed;
// - a migration's, recorded on a stream S when another stream wants memory
//   S freed: once it completes, every block S freed before it is ready.
//   One event covers them all, hence the free counter ("watermark").
//
// Thread safety: none; the cache's mutex guards it. Functions taking the
// cache's lock release it while they wait and hold it again on return and
// on a throw. StreamOps' exceptions (CUDA errors) pass through; the state
// stays consistent.
#pragma once

#include <cstdint>
#include <deque>
#include <mutex>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "torch_plugin/block_cache.h"
#include "torch_plugin/block_pool.h"

namespace leasehold::torch_plugin::detail {

// ---- events on several streams at once -------------------------------------------

struct Recorded {
  StreamId stream;
  EventId event;
};
// Records one event on each of `targets`; all or none (on a throw the ones
// recorded are destroyed).
std::vector<Recorded> record_each(StreamOps& streams, const std::vector<StreamId>& targets);
void destroy_all(StreamOps& streams, const std::vector<Recorded>& evs);
// Waits for `evs` with `lk` released; it is held again on return and on a
// throw. The events stay the caller's to destroy.
void wait_unlocked(std::unique_lock<std::mutex>& lk, StreamOps& streams,
                   const std::vector<Recorded>& evs);
// Records an event on each of `targets` now and waits for them all with
// `lk` released (held again on return and on a throw): every stream has
// then run what was queued on it before this call. The events are gone.
void reach_now(std::unique_lock<std::mutex>& lk, StreamOps& streams,
               const std::vector<StreamId>& targets);

// ---- the cache's events ---------------------------------------------------------

class StreamOrder {
 public:
  // `streams` and `pool` must outlive it; completed events make the pool's
  // blocks free or ready.
  StreamOrder(StreamOps& streams, BlockPool& pool) : streams_(streams), pool_(pool) {}
  StreamOrder(const StreamOrder&) = delete;
  StreamOrder& operator=(const StreamOrder&) = delete;

  // Notes a stream the cache has handed memory to or seen used: these are
  // the streams whose work must finish before the memory goes for good.
  void saw(StreamId stream) { known_.insert(stream); }
  const std::unordered_set<StreamId>& known_streams() const { return known_; }

  // The free counter's next value, for a block freed now (Block::free_seq).
  uint64_t stamp_free() { return ++free_seq_; }

  // Whether any event is outstanding.
  bool has_pending() const { return pending_events_ != 0; }
  // Handles every event that completed (queries, never waits).
  void process_events();
  // Records a migration event on each other stream holding a free block of
  // the pool large enough for `size`, unless one is outstanding there or the
  // stream is being captured. Returns whether it recorded any.
  bool start_migrations(bool small, uint64_t size, StreamId stream);
  // The last resort before segments go back: waits (with `lk` released)
  // until every free block of the pool, other streams' and waiting ones, is
  // reusable. Returns whether it waited for anything.
  bool drain(std::unique_lock<std::mutex>& lk, bool small, StreamId stream);
  // Before pages are unbacked: waits (with `lk` released) until every free
  // block of both pools is ready, the streams' own included (their queued
  // work may still touch them). Streams being captured are left alone.
  // Returns whether it waited for anything.
  bool drain_all(std::unique_lock<std::mutex>& lk);
  // Freed block `b`, used on `uses` too (record_stream; its own stream not
  // among them), becomes kWaiting until an event recorded now on each of
  // them completed. Throws what StreamOps::record throws, `b` untouched.
  void await_users(Block* b, const std::vector<StreamId>& uses);

  // Destroys every outstanding event: the cache goes away. Never throws.
  void abandon_events() noexcept;
  // Whether the count of outstanding events matches the queues (checks).
  bool pending_count_consistent() const;

 private:
  // drain's work: waits until the streams `wanted` and those with events
  // pending reached an event recorded now, and promotes what they freed.
  bool reach(std::unique_lock<std::mutex>& lk, std::set<StreamId> wanted);

  // An event outstanding on a stream: a record_stream user's (for `block`)
  // or a migration's (every block the stream freed up to `watermark`
  // becomes ready).
  struct Pending {
    EventId event = 0;
    Block* block = nullptr;
    uint64_t watermark = 0;
  };
  void complete(StreamId s, const Pending& done);

  StreamOps& streams_;
  BlockPool& pool_;
  std::unordered_map<StreamId, std::deque<Pending>> pending_;  // in record order per stream
  size_t pending_events_ = 0;
  std::unordered_set<StreamId> migrating_;  // streams with a migration event outstanding
  std::unordered_set<StreamId> known_;
  uint64_t free_seq_ = 0;
};

}  // namespace leasehold::torch_plugin::detail
