// The physical pages a job holds: the chunks of its leases. Pages are
// leased from the coordinator a lease at a time and handed one by one to
// the job's window (paged_resource.h), which may show any of them at any
// address: which lease a page came from does not matter to where tensors
// go, and a request the pool has no contiguous run for is leased in
// pieces. Leases go back whole, or their free tail, when memory is given
// back.
//
// The occupancy policy's rules for growing live here: within the budget,
// within the guaranteed share a lease may wait (the policy makes room);
// past it growth is opportunistic (refused at once, then not asked again
// for `growth_backoff`), except once armed by allow_patient_growth(), the
// last resort when nothing more can be spilled: that request says it is
// needed (LeaseRequest.needed) and waits `guaranteed_wait`.
//
// Thread safety: none; the paged resource's lock covers it.
#pragma once

#include <chrono>
#include <cstdint>
#include <list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "lease_client/session.h"

namespace leasehold {

struct LeasedPagesOptions {
  // Most bytes leased at once (0: as much as the pool gives).
  uint64_t budget_bytes = 0;
  // The usual lease (rounded to pages); larger when a request needs more.
  uint64_t lease_bytes = 32ull << 20;
  // How long a lease may wait for the coordinator to find memory.
  std::chrono::milliseconds lease_wait{0};
  // The job's guaranteed share (0: none; every lease waits `lease_wait`),
  // and how long a lease within it waits (nullopt: the coordinator's
  // default). See above.
  uint64_t guaranteed_bytes = 0;
  std::optional<std::chrono::milliseconds> guaranteed_wait;
  std::chrono::milliseconds growth_backoff{1000};
};

class LeasedPages {
 public:
  // `session` must outlive this.
  LeasedPages(AgentSession& session, LeasedPagesOptions options);
  // Releases every lease (best effort, logged): whoever showed its pages
  // hid them first, after the device finished with them.
  ~LeasedPages();
  LeasedPages(const LeasedPages&) = delete;
  LeasedPages& operator=(const LeasedPages&) = delete;

  // The mapping the pages are chunks of (the session's when the first page
  // was asked for); null before. Pages of another mapping (a coordinator
  // restart) are never handed out.
  const std::shared_ptr<PoolMapping>& mapping() const { return mapping_; }
  uint64_t page_size() const { return page_size_; }

  // Takes the session's current mapping for the pages' (once). False (why
  // in `why`) when the session is not registered, or lost since: its
  // memory went with it.
  bool bind(std::string& why);
  // `n` pages (chunk indices of the mapping): free ones first, then a new
  // lease within the budget. All or none: nullopt when the budget, the
  // growth rules or the coordinator say no (why in `why`).
  std::optional<std::vector<uint64_t>> take(uint64_t n, std::string& why);
  // `n` pages only if that many are free now (no lease).
  std::optional<std::vector<uint64_t>> take_free(uint64_t n);
  // A page taken earlier is free again (shown nowhere).
  void give(uint64_t chunk);
  // Gives the coordinator back every lease with no page taken and the free
  // tail of the others. Returns the bytes given back.
  uint64_t release_free();

  // The last resort: the next growth past the guaranteed share may wait,
  // and says it is needed. False when there is no guaranteed share or it
  // was armed already since the last allocation that succeeded (settle()).
  bool allow_patient_growth();
  void settle() { patience_ = Patience::Off; }
  // Advice for an error after a patient request the pool had no room for
  // (empty when there is none).
  std::string advice(uint64_t need) const;
  // True once the session the pages were bound to is gone (a coordinator
  // restart): no page will be handed out again.
  bool lost() const { return mapping_ && session_.current_mapping() != mapping_; }

  uint64_t held_bytes() const { return held_; }
  uint64_t peak_held_bytes() const { return peak_held_; }
  uint64_t lease_count() const { return leases_.size(); }
  uint64_t free_pages() const { return free_; }
  uint64_t budget() const { return opt_.budget_bytes; }

 private:
  struct Held {
    Lease lease;
    uint64_t first = 0;        // its first chunk
    std::vector<bool> taken;   // per page
    uint64_t free = 0;
  };
  enum class Patience { Off, Armed, Used };

  // Leases `pages` pages (at least), within the rules above.
  bool grow(uint64_t pages, std::string& why);
  // `need` bytes in several leases where the pool has no run that long.
  bool lease_pieces(uint64_t need, bool patient, std::string& why);
  // A lease of `bytes`; false when refused (why in `why`). `wait_for`: how
  // long it may wait, instead of what the rules above say.
  bool lease(uint64_t bytes, bool patient, std::string& why,
             std::optional<std::chrono::milliseconds> wait_for = std::nullopt);
  bool growth_held() const;
  std::vector<uint64_t> pop(uint64_t n);

  AgentSession& session_;
  LeasedPagesOptions opt_;
  std::shared_ptr<PoolMapping> mapping_;
  uint64_t page_size_ = 0;
  std::list<Held> leases_;
  uint64_t held_ = 0, peak_held_ = 0, free_ = 0;
  std::chrono::steady_clock::time_point no_growth_until_{};
  Patience patience_ = Patience::Off;
  std::optional<ErrorCode> last_refusal_;
  bool patient_refused_ = false;  // the last patient request found no room
};

}  // namespace leasehold
