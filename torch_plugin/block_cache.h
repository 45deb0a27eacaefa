// The stream-ordered caching allocator behind the PyTorch plug-in
// (libleasehold_torch.so), written against two small interfaces so that it
// runs and is tested on the host: memory comes from a LeaseSource (leases of
// the job's session in the plug-in; malloc'd buffers in the tests) and stream
// order from StreamOps (CUDA streams and events in the plug-in; streams the
// test completes by hand).
//
// Semantics, after PyTorch's CUDA caching allocator:
// - Two pools. Requests up to `small_limit` (1 MiB) come from small segments
//   (2 MiB leases); larger ones from large segments, each one lease of at
//   least the request (rounded to the lease alignment) and at least
//   `min_large_segment` (20 MiB) where the budget leaves room for it. Within
//   a pool: best fit over free blocks (O(log n)), the rest split off (in the
//   large pool only when more than `small_limit` remains, so large segments
//   are not cut into crumbs), free neighbours merged on free.
// - Streams. A block freed on stream S is reusable at once by allocations on
//   S (S runs in order). Another stream may use it only after an event
//   recorded on S no earlier than the free has completed, and after events
//   recorded at free time on every stream the block was marked used on
//   (record_stream); those events are recorded at free time (used streams)
//   or when another stream needs the memory (S: one event then covers every
//   block S freed before it). A block with record_stream users is not
//   reused at all, even by S, until their events completed. Nothing here
//   waits for a whole device: waits are on single events.
// - Budget. At most `budget_bytes` leased at once. An allocation that finds
//   no block: leases a new segment if the budget allows; otherwise (or when
//   the lease source refuses) it waits for the streams holding free blocks
//   of its pool to reach the events that make those blocks reusable, then
//   releases fully free segments (their events completed first), then,
//   where the lease source pages its leases (LeaseSource::page_size), takes
//   the whole pages of free blocks inside partly used segments back
//   ("unbacks" them: their addresses stay in the segment, marked kUnbacked,
//   and their memory backs the new segment), and leases again; then it
//   fails with OutOfMemory naming the request, the bytes in use, the bytes
//   cached and the budget. With a paging source cached fragments never
//   make an allocation fail: it fails only when the pages live blocks
//   touch and the request exceed the budget (expandable segments, in
//   PyTorch's words). An unbacked range is not backed again; its addresses
//   come back when its segment is free and goes back.
// - CUDA graphs. During stream capture no event is recorded or queried on
//   the capturing stream, only blocks whose stream work is known complete
//   ("ready") or fresh leases are handed out, and every block allocated or
//   freed during a capture is kept aside when freed, never reused, until
//   empty_cache() runs when no capture seen is still under way. The rule is
//   conservative but simple: a captured graph may be replayed later against
//   any block it used. It requires that a program calls empty_cache() only
//   after the graphs it captured are gone (see docs/torch-plugin.md).
//
// Thread safety: every method may be called from any thread. One mutex
// guards the state; it is not held while the lease source is asked for or
// given back memory, nor while waiting for events, so frees and allocations
// of other threads go on meanwhile (trim from a Shrink, for example).
//
// Errors: allocate throws OutOfMemory when the memory cannot be had,
// LeaseFailure when the lease source cannot go on (a lost session), and
// whatever StreamOps throws (CUDA errors). free/record_stream throw
// std::invalid_argument for a pointer this cache did not hand out. The state
// stays consistent through every exception.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace leasehold::torch_plugin {

// An opaque stream (a cudaStream_t in the plug-in) and event.
using StreamId = uintptr_t;
using EventId = uintptr_t;

// Memory a LeaseSource granted: `size` bytes at `base`; `id` is the source's.
struct Lease {
  void* base = nullptr;
  uint64_t size = 0;
  uint64_t id = 0;
};

class LeaseSource {
 public:
  enum class Result {
    kGranted,  // *lease filled in
    kRefused,  // not now (the pool is full, a budget, a queue that timed out)
    kFailed,   // never again (the session is lost): the cache throws LeaseFailure
  };
  virtual ~LeaseSource() = default;
  // Leases at least `bytes` bytes. `last_resort`: the cache has nothing left
  // to give back. On kRefused/kFailed, `why` says why. Must not throw.
  // Called without the cache's lock held, possibly from several threads.
  virtual Result acquire(uint64_t bytes, bool last_resort, Lease* lease, std::string* why) = 0;
  // Gives lease `id` back; every use of its memory has completed. Must not
  // throw.
  virtual void release(uint64_t id) noexcept = 0;

  // Paging: a source whose leases are pages shown in a window (the
  // plug-in's: lease_client/leasehold.h, lh_window_*) can take single pages
  // of a lease back, so that free memory inside a partly used segment
  // backs other segments. The size of such a page; 0 (the default): leases
  // are not paged. Otherwise every lease's size is a multiple of it, and
  // its pages start at its base.
  virtual uint64_t page_size() const { return 0; }
  // Pages [offset, offset + bytes) of lease `id` (multiples of the page
  // size, relative to its base) show nothing any more, and their memory
  // may back other leases; every use of them completed. The cache never
  // uses the range again, whatever happens here: a source that could not
  // hide some page keeps that page's memory held (and says so) until the
  // lease is released. Called with the cache's lock held: it must be quick
  // (no coordinator round trip) and must not throw.
  virtual void unback(uint64_t id, uint64_t offset, uint64_t bytes) noexcept {
    (void)id, (void)offset, (void)bytes;
  }
  // Gives the coordinator back what no lease of the cache shows any more
  // (unback leaves it for the next lease, which then needs no new
  // memory). Returns the bytes given back. Called without the cache's
  // lock. Must not throw.
  virtual uint64_t give_back_unused() noexcept { return 0; }
};

class StreamOps {
 public:
  virtual ~StreamOps() = default;
  // Records a new event on `stream`: it completes once the work queued on
  // the stream before it has. Throws on failure.
  virtual EventId record(StreamId stream) = 0;
  // Whether `event` completed (never blocks). Throws on failure.
  virtual bool query(EventId event) = 0;
  // Blocks the calling thread until `event` completed. Throws on failure.
  virtual void wait(EventId event) = 0;
  // The event is no longer needed (completed or abandoned).
  virtual void destroy(EventId event) noexcept = 0;
  // Whether `stream` is being captured into a graph now. Throws on failure.
  virtual bool capturing(StreamId stream) = 0;
};

struct BlockCacheOptions {
  // Most bytes leased at once; 0: no limit of the cache's own (the lease
  // source may still refuse).
  uint64_t budget_bytes = 0;
  // Leases are multiples of this (the pool's lease alignment); not 0.
  uint64_t lease_alignment = 2ull << 20;
  // Requests up to this go to the small pool.
  uint64_t small_limit = 1ull << 20;
  // Lease size of a small segment.
  uint64_t small_segment = 2ull << 20;
  // Smallest large segment, where the budget leaves room (fewer leases for
  // a run of middle-sized requests, at the cost of holding up to this much
  // more than needed).
  uint64_t min_large_segment = 20ull << 20;
  // Block sizes and offsets are multiples of this; a power of two.
  uint64_t granularity = 512;
};

struct BlockCacheStats {
  // Leased now (including segments being released), less the unbacked
  // pages of segments: what counts against the budget.
  uint64_t leased_bytes = 0;
  uint64_t peak_leased_bytes = 0;
  uint64_t in_use_bytes = 0;  // in blocks handed out now (rounded sizes)
  uint64_t peak_in_use_bytes = 0;
  uint64_t allocations = 0;         // successful allocate() calls
  uint64_t cache_hits = 0;          // ... of them served without a new lease
  uint64_t lease_requests = 0;      // acquire() calls, granted or not
  uint64_t failed_allocations = 0;  // OutOfMemory thrown
  uint64_t segments = 0;            // leases held now
  uint64_t held_bytes = 0;          // freed blocks kept aside for CUDA graphs
  uint64_t unbacked_bytes = 0;      // pages of segments unbacked now (paging sources)
  uint64_t unbacks = 0;             // times free pages were unbacked
  uint64_t budget_bytes = 0;        // the option (0: none)
};

// Out of memory: the message names the request, the bytes in use, the bytes
// cached and the budget, e.g. "leasehold: cannot allocate 512.00 MiB: 5.50
// GiB in use, 256.00 MiB cached, budget 6.00 GiB".
class OutOfMemory : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The lease source cannot go on (LeaseSource::Result::kFailed).
class LeaseFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a segment holds, for tests and debugging.
struct BlockInfo {
  enum class State { kLive, kFree, kWaiting, kHeld, kReleasing, kUnbacked };
  uintptr_t addr = 0;
  uint64_t size = 0;
  State state = State::kFree;
  bool ready = false;   // kFree: reusable by any stream
  StreamId stream = 0;  // kLive: its stream; otherwise the stream that freed it
};
struct SegmentInfo {
  uintptr_t base = 0;
  uint64_t size = 0;
  bool small = false;
  std::vector<BlockInfo> blocks;  // in address order
};

class BlockCache {
 public:
  // `leases` and `streams` must outlive the cache.
  // Throws std::invalid_argument for inconsistent options.
  BlockCache(LeaseSource& leases, StreamOps& streams, BlockCacheOptions options = {});
  // Waits for the events its free memory needs and releases every lease,
  // blocks still in use included (their memory is gone). Never throws.
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // A block of at least `bytes` (> 0) bytes for work on `stream`.
  void* allocate(uint64_t bytes, StreamId stream);
  // Frees a block allocate() returned (its stream is the one it was
  // allocated on).
  void free(void* ptr);
  // Marks the live block at `ptr` as used on `stream` too.
  void record_stream(void* ptr, StreamId stream);
  // Releases fully free cached segments until at least `bytes` were
  // released (or none is left), waiting only for the events their blocks
  // need, then unbacks free pages of partly used ones (a paging source)
  // for the rest. Returns the bytes released and unbacked.
  uint64_t trim(uint64_t bytes);
  // Returns blocks kept aside for CUDA graphs to the cache when no capture
  // seen is still under way, then trims everything. Returns the bytes
  // released and unbacked.
  uint64_t empty_cache();

  BlockCacheStats stats() const;
  // The size of the live block at `ptr` (0 when there is none).
  uint64_t block_size(const void* ptr) const;
  std::vector<SegmentInfo> segments() const;
  // "" when the internal invariants hold, else what is wrong (tests).
  std::string check_invariants() const;

 private:
  // What mu_ guards: the parts the cache is made of (block_cache_state.h).
  struct State;

  LeaseSource& leases_;
  StreamOps& streams_;
  const BlockCacheOptions opt_;
  mutable std::mutex mu_;
  std::unique_ptr<State> s_;  // GUARDED_BY(mu_)
};

// "1.50 GiB", "512.00 MiB", "300 B": for messages.
std::string format_bytes(uint64_t bytes);

}  // namespace leasehold::torch_plugin
