// The memory resource a job's tensors come from: leased pages (chunks of
// the pool, leased_pages.h) shown in a window of this process's address
// space (shared/chunk_window.h). Tensors are placed best fit on its
// addresses, small ones (up to `small_limit`, and those of under
// kFewPages pages that end within a page) from the top end and the rest
// from the bottom, as the pool places regions and scratch, so small
// tensors do not pin pages among large ones (a GPT's activations are
// whole pages, its weights' gradients and bfloat16 copies a page or two
// and a part: among the activations each showed a page for its part; at
// half the GPT job's peak, 44% fewer pages shown, and a step that spilled
// 48 MiB fits); a tensor whose best fit lands
// on pages that show nothing goes instead to a hole whose pages still show,
// when there is one. A page is shown while a live tensor touches it.
//
// Why it cannot fragment: addresses are plentiful (the window spans four
// times the most the job may hold) and pages are interchangeable. A tensor
// needs pages only for the part of its range that shows none; when no
// page is free and the budget allows no lease, pages that no live tensor
// touches are hidden (after the device is done with them) and shown where
// they are needed. So an allocation fails only when the pages its range
// needs and the pages live tensors touch exceed the budget; the cached
// fragments of a caching allocator never count. PyTorch's expandable
// segments grow one range the same way.
//
// Pages stay shown when their tensors go (the next tensor there needs no
// mapping call); release_cached() hides them and gives the coordinator
// back whole leases and free lease tails. Before pages are hidden or
// leases given back the resource waits for the device (`fence`).
//
// Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "agent/memory/leased_pages.h"
#include "agent/memory/memory_resource.h"
#include "shared/chunk_window.h"
#include "shared/pool_allocator.h"

namespace leasehold {

struct PagedResourceOptions {
  LeasedPagesOptions pages;
  uint64_t small_limit = 1ull << 20;  // allocations up to this are placed from the top
  uint64_t granularity = 512;         // tensor addresses and sizes are multiples of this
  // Waits until the device finished with memory freed on `streams` (and
  // any other work of this process on it): before pages are hidden or
  // leases given back. Empty: nothing to wait for (host memory).
  std::function<void(const std::vector<StreamRef>& streams)> fence;
};

class PagedResource final : public MemoryResource {
 public:
  // `session` must outlive the resource and all memory it hands out.
  PagedResource(AgentSession& session, PagedResourceOptions options);
  // Fences, hides every page and gives every lease back. Logs, never throws.
  ~PagedResource() override;

  void* allocate(uint64_t bytes, StreamRef stream) override;
  void deallocate(void* p, uint64_t bytes, StreamRef stream) noexcept override;
  void* allocate_if_free(uint64_t bytes, StreamRef stream) override;

  // Hides pages no live tensor touches (after the fence) and gives back
  // whole free leases and free lease tails. Returns the bytes given back.
  // Throws what the fence throws (a device fault).
  uint64_t release_cached();
  // For a tensor of `bytes`: when no free range has all but the free
  // chunks' worth of its pages shown already (no mapping, no lease), hides
  // pages no live tensor touches (after the fence): as many as the range
  // that lacks the fewest needs, the farthest from it first, when enough
  // lie outside it; else all of them. Their chunks stay the job's, to be
  // shown where the tensor lands. Returns the pages hidden.
  uint64_t make_room(uint64_t bytes);
  // The last resort before an allocation fails (LeasedPages), and its end
  // when that allocation failed all the same.
  bool allow_patient_growth();
  void disarm_patient_growth();

  struct Stats {
    uint64_t held_bytes = 0;       // leased now
    uint64_t peak_held_bytes = 0;
    uint64_t live_bytes = 0;       // of live tensors, rounded to the granularity
    uint64_t shown_pages = 0;      // pages shown in the window
    uint64_t leases = 0;
    uint64_t pages_mapped = 0;     // pages shown so far (mapping calls' pages)
    uint64_t trims = 0;            // times idle pages were hidden (each after a fence)
  };
  Stats stats() const;
  engine::Device device() const { return device_; }

 private:
  struct Window {
    std::unique_ptr<ChunkWindow> pages;
    PoolAllocator blocks;  // address ranges inside it
    std::vector<uint32_t> touching;  // per page: live tensors touching it
    std::vector<uint64_t> chunk;     // per page: the chunk it shows + 1; 0: none
    uint64_t shown_end = 0;          // one past the last page ever shown
    Window(std::unique_ptr<ChunkWindow> w, uint64_t granularity);
  };
  struct Placement {
    uint64_t offset, size;
  };

  // Opens the window on the first allocation. REQUIRES: mu_ held.
  bool open_window(std::string& why);
  // Places `need` bytes: the range, then pages for its unshown part. nullptr
  // when there is no room (why in `why`); `free_only`: pages already held
  // only, nothing hidden. REQUIRES: mu_ held.
  void* place(uint64_t need, bool free_only, std::string& why);
  // The pages [first, last] a range touches.
  std::pair<uint64_t, uint64_t> pages_of(uint64_t offset, uint64_t size) const;
  // Whether a tensor of `need` bytes is placed from the top (see the top).
  bool from_top(uint64_t need) const;
  static constexpr uint64_t kFewPages = 4;  // (pages)
  // Pages of [offset, offset + size) that show nothing. REQUIRES: mu_ held.
  uint64_t unshown(uint64_t offset, uint64_t size) const;
  // A free range of `need` bytes that needs fewer than `than` pages shown
  // (a hole whose pages still show), the fewest of any: at either end of a
  // free block or, with `inside`, on a page boundary within it (not for
  // small tensors, kept at the window's top end); nullopt when there is
  // none. REQUIRES: mu_ held.
  std::optional<uint64_t> fewer_unshown(uint64_t need, uint64_t than, bool inside) const;
  // Hides pages no live tensor touches, after the fence, so their chunks
  // are free again: at least `want` (when there are), and with `spare`
  // half of the rest with them, so the next shortage does not wait for the
  // device again; the farthest from pages [near_first, near_last] first
  // (what is placed next tends to go near what was placed last). Returns
  // how many. REQUIRES: mu_ held.
  uint64_t hide_idle(uint64_t want, uint64_t near_first = 0, uint64_t near_last = 0,
                     bool spare = true);
  void fence();  // REQUIRES: mu_ held
  [[noreturn]] void out_of_memory(uint64_t bytes, const std::string& why, bool permanent);

  AgentSession& session_;
  PagedResourceOptions opt_;
  engine::Device device_;
  mutable std::mutex mu_;
  LeasedPages pages_;                                // GUARDED_BY(mu_); outlives the window
  std::unique_ptr<Window> window_;                   // GUARDED_BY(mu_)
  std::unordered_map<void*, Placement> placements_;  // GUARDED_BY(mu_)
  std::set<StreamRef> freed_on_;                     // GUARDED_BY(mu_): since the last fence
  uint64_t live_ = 0, shown_ = 0, idle_shown_ = 0;   // GUARDED_BY(mu_)
  uint64_t pages_mapped_ = 0, trims_ = 0;            // GUARDED_BY(mu_)
};

}  // namespace leasehold
