// Leases of the job's session with the coordinator (lease_client/
// leasehold.h) as the block cache's LeaseSource (block_cache.h), paged: a
// segment the cache asks for is a run of pages of one window of this
// process (lh_window_*), and each page shows a page of some lease. Pages
// the cache unbacks (free pages inside partly used segments) go to a stock
// of free pages, which backs the next segment before any new lease is
// asked for; a lease none of whose pages shows anywhere goes back to the
// coordinator when a segment is released or the cache trims. So the job
// holds what its segments show, and free memory is never stranded between
// live tensors (block_cache.h, "Budget").
//
// Memory goes back to the coordinator a whole lease at a time, so the
// memory a segment needs is leased in pieces of at most `piece_bytes`: the
// pages the cache unbacks go back once they cover a whole piece, rather
// than only when the whole segment is free. Unbacked pages of a piece
// other pages of which still show stay in the stock. The stock backs new
// segments from the leases with the fewest free pages first, so that
// leases mostly free become wholly free.
//
// A full pool, a queue that timed out, a request too large and a window
// with no run of free addresses left are refusals: the cache may give
// memory back and ask again. A lost session is a failure, and `on_lost` is
// told (the plug-in then reports it at every later allocation).
//
// Leases follow the occupancy policy's growth rules (growth_rule.h): past
// the job's guaranteed share they are asked for without waiting, and a
// last-resort lease asked for inside a NeededGrowth scope (the pressure
// handler had nothing left to spill) says it is needed. The pieces of one
// segment are asked for one after the other, alike: each may wait the
// coordinator's default where the rule lets leases wait, so a segment of k
// pieces may wait up to k times that while the policy makes room; those
// granted are held while the next waits, and all go back if one is
// refused.
//
// Thread safety: any thread; one mutex guards the pages, and it is not
// held while the coordinator is asked for a lease or given one back.
// Never throws.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "leasehold.h"
#include "torch_plugin/block_cache.h"
#include "torch_plugin/growth_rule.h"

namespace leasehold::torch_plugin {

// While one lives, this thread's last-resort leases are needed ones.
class NeededGrowth {
 public:
  NeededGrowth();
  ~NeededGrowth();
  NeededGrowth(const NeededGrowth&) = delete;
  NeededGrowth& operator=(const NeededGrowth&) = delete;
  static bool active();

 private:
  bool was_;
};

class SessionLeases final : public LeaseSource {
 public:
  // Called with the reason when the session is found lost: from any
  // thread, possibly several at once, and possibly with the pages' lock
  // held, so it must not call back into the SessionLeases.
  using LostFn = std::function<void(const std::string&)>;

  // `session` must outlive it. `page` is the pool's alignment;
  // `window_bytes` the address space reserved (at the first lease) for all
  // segments together, unbacked holes included: several times the most
  // the job may hold. `guaranteed`: the job's guaranteed share (0: none
  // known, every lease may wait). `piece_bytes`: the most one lease holds,
  // rounded down to whole pages, at least one (0: a segment's memory in
  // one lease).
  SessionLeases(lh_session* session, uint64_t page, uint64_t window_bytes, uint64_t guaranteed,
                uint64_t piece_bytes, LostFn on_lost);
  // Closes the window and gives every lease back: segments still held are
  // void. (The plug-in never destroys its one; tests do.)
  ~SessionLeases() override;
  SessionLeases(const SessionLeases&) = delete;
  SessionLeases& operator=(const SessionLeases&) = delete;

  Result acquire(uint64_t bytes, bool last_resort, Lease* out, std::string* why) override;
  // A failure is printed on standard error (a lost session is noted).
  void release(uint64_t id) noexcept override;
  uint64_t page_size() const override { return page_; }
  void unback(uint64_t id, uint64_t offset, uint64_t bytes) noexcept override;
  uint64_t give_back_unused() noexcept override;

 private:
  // A lease and which of its pages a segment shows.
  struct Held {
    lh_lease* lease = nullptr;
    std::vector<bool> shown;
    uint64_t shown_count = 0;
  };
  // A page of a held lease: (the Held's key, page index in it).
  using PageRef = std::pair<uint64_t, uint64_t>;
  struct Segment {
    uint64_t first = 0;          // its first page in the window
    std::vector<PageRef> pages;  // per page; kNone: unbacked
  };
  static constexpr PageRef kNone{0, 0};

  // Shows `pages` at window page `first` on, in runs of consecutive pages
  // of one lease. On failure hides what it showed and returns the status,
  // its message in `error`; `*hidden` false when even the hide failed (the
  // pages may still show).
  // REQUIRES: mu_ held.
  lh_status show(uint64_t first, const std::vector<PageRef>& pages, bool* hidden,
                 std::string* error);
  // Page `ref` shows nowhere any more: back into the stock. REQUIRES: mu_.
  void to_stock(const PageRef& ref);
  // Takes the leases none of whose pages shows out of the books; the
  // caller releases them without the lock. REQUIRES: mu_ held.
  std::vector<lh_lease*> take_unused();
  // Takes `n` pages out of the stock into `pages`, marked shown, from the
  // leases with the fewest free pages first; fewer where the stock has
  // fewer. REQUIRES: mu_ held.
  void take_from_stock(uint64_t n, std::vector<PageRef>* pages);
  // Releases leases taken out of the books. Returns their bytes.
  uint64_t release_leases(const std::vector<lh_lease*>& leases) noexcept;
  // A run of `n` free window pages (first fit); false when there is none.
  // REQUIRES: mu_ held.
  bool take_addresses(uint64_t n, uint64_t* first);
  void give_addresses(uint64_t first, uint64_t n);  // REQUIRES: mu_ held
  // A refusal or failure of the session, as acquire reports it: `what`,
  // the status and `detail` (empty: lh_last_error()).
  Result failure(lh_status st, const std::string& what, std::string* why,
                 const std::string& detail = "");

  lh_session* const session_;
  const uint64_t page_;
  const uint64_t window_bytes_;
  const uint64_t piece_;  // bytes, whole pages
  const LostFn on_lost_;
  std::mutex mu_;
  lh_window* window_ = nullptr;              // GUARDED_BY(mu_); opened at the first lease
  std::map<uint64_t, uint64_t> free_runs_;   // GUARDED_BY(mu_); first page -> count
  std::map<uint64_t, Held> held_;            // GUARDED_BY(mu_); by key (from 1)
  std::set<PageRef> stock_;                  // GUARDED_BY(mu_); free pages of held leases
  std::unordered_map<uint64_t, Segment> segments_;  // GUARDED_BY(mu_)
  uint64_t next_key_ = 1, next_id_ = 1;      // GUARDED_BY(mu_)
  GrowthRule growth_;  // GUARDED_BY(mu_)
};

}  // namespace leasehold::torch_plugin
