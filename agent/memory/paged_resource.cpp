#include "agent/memory/paged_resource.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>

#include "shared/units.h"

namespace leasehold {

namespace {
// The window spans this many times the most the job may hold: addresses
// cost nothing, and best fit over that much room does not run out of
// ranges before the pages run out.
constexpr uint64_t kWindowSpan = 4;
}  // namespace

PagedResource::Window::Window(std::unique_ptr<ChunkWindow> w, uint64_t granularity)
    : pages(std::move(w)),
      blocks(pages->page_count() * pages->page_size(), granularity),
      touching(pages->page_count(), 0),
      chunk(pages->page_count(), 0) {}

PagedResource::PagedResource(AgentSession& session, PagedResourceOptions options)
    : session_(session),
      opt_(std::move(options)),
      device_(pool_device(session.pool())),
      pages_(session, opt_.pages) {
  if (!is_power_of_two(opt_.granularity) || opt_.granularity < 256) {
    throw std::invalid_argument("the allocation granularity must be a power of two >= 256");
  }
}

PagedResource::~PagedResource() {
  std::lock_guard lock(mu_);
  if (!placements_.empty()) {
    spdlog::error("a job's memory resource destroyed with {} allocations ({}) still in use",
                  placements_.size(), format_bytes(live_));
  }
  if (pages_.lease_count() > 0) {
    try {
      fence();
    } catch (const std::exception& e) {
      // The device faulted; nothing queued will run any more.
      spdlog::error("waiting for device work before giving leases back: {}", e.what());
    }
  }
  // The window first: no page shows a chunk once its lease goes.
  window_.reset();
}

void PagedResource::fence() {
  std::vector<StreamRef> streams(freed_on_.begin(), freed_on_.end());
  if (opt_.fence) opt_.fence(streams);
  freed_on_.clear();
}

bool PagedResource::open_window(std::string& why) {
  if (window_) return true;
  if (!pages_.bind(why)) return false;
  const PoolDescriptor& pool = pages_.mapping()->descriptor();
  const uint64_t cap = pages_.budget() ? std::min(pages_.budget(), pool.size) : pool.size;
  const uint64_t pages = kWindowSpan * ((cap + pool.alignment - 1) / pool.alignment) + 2;
  try {
    window_ = std::make_unique<Window>(leasehold::open_window(pages_.mapping(), pages),
                                       opt_.granularity);
  } catch (const std::exception& e) {
    why = e.what();
    return false;
  }
  return true;
}

bool PagedResource::from_top(uint64_t need) const {
  // (A tensor of a few pages and a part, among tensors of whole pages,
  // shows a page for that part alone; among other such tensors, the pages
  // it shares with them.)
  const uint64_t page = window_->pages->page_size();
  return need <= opt_.small_limit || (need % page != 0 && need < kFewPages * page);
}

std::pair<uint64_t, uint64_t> PagedResource::pages_of(uint64_t offset, uint64_t size) const {
  const uint64_t page = window_->pages->page_size();
  return {offset / page, (offset + size - 1) / page};
}

uint64_t PagedResource::unshown(uint64_t offset, uint64_t size) const {
  const auto [first, last] = pages_of(offset, size);
  uint64_t n = 0;
  for (uint64_t p = first; p <= last; ++p) n += window_->chunk[p] == 0;
  return n;
}

std::optional<uint64_t> PagedResource::fewer_unshown(uint64_t need, uint64_t than,
                                                     bool inside) const {
  const Window& w = *window_;
  std::optional<uint64_t> best;
  auto better = [&](uint64_t at, uint64_t n) {
    if (n >= than) return false;
    best = at;
    than = n;
    return n == 0;
  };
  // With `inside`, not only at a free range's ends: where a freed arena's
  // pages lie between ranges that show none (its neighbours were freed
  // too), the range starting on its first page shows them all. Starts on
  // page boundaries (the granularity's, where larger), with a running
  // count of the unshown pages, up to the last page ever shown: a range
  // past it shows nothing.
  const uint64_t page = w.pages->page_size();
  const uint64_t step = std::max(page, opt_.granularity);
  for (const PoolAllocator::Block& b : w.blocks.free_blocks()) {
    if (b.size < need) continue;
    const uint64_t last_start = b.offset + b.size - need;
    if (better(b.offset, unshown(b.offset, need)) ||
        better(last_start, unshown(last_start, need))) {
      return best;
    }
    if (!inside) continue;
    const uint64_t stop = std::min(last_start, w.shown_end * page);
    uint64_t at = (b.offset / step + 1) * step;
    if (at >= stop) continue;
    uint64_t n = unshown(at, need);
    auto [first, last] = pages_of(at, need);
    while (!better(at, n) && at + step < stop) {
      at += step;
      const auto [next_first, next_last] = pages_of(at, need);
      if (next_first > last) {
        n = unshown(at, need);
      } else {
        for (uint64_t p = first; p < next_first; ++p) n -= w.chunk[p] == 0;
        for (uint64_t p = last + 1; p <= next_last; ++p) n += w.chunk[p] == 0;
      }
      first = next_first;
      last = next_last;
    }
    if (than == 0) return best;
  }
  return best;
}

void* PagedResource::place(uint64_t need, bool free_only, std::string& why) {
  Window& w = *window_;
  const auto end = from_top(need) ? PoolAllocator::End::High : PoolAllocator::End::Low;
  auto block = w.blocks.allocate(need, end);
  if (!block) {
    why = "no free range of " + format_bytes(need) + " is left in the job's window of " +
          format_bytes(w.blocks.pool_size());
    return nullptr;
  }
  // Best fit on addresses may land where no page shows; another free range
  // may be a hole whose pages still show (no mapping call, no page taken).
  // (Searched with its own range free again: the best place may overlap it.)
  if (const uint64_t n = unshown(block->offset, block->size); n > 0) {
    const uint64_t first_choice = block->offset, size = block->size;
    w.blocks.free(first_choice);
    const std::optional<uint64_t> at = fewer_unshown(size, n, /*inside=*/!from_top(need));
    auto there = w.blocks.allocate_at(at ? *at : first_choice, need);  // free: it is there
    block = there ? there : w.blocks.allocate(need, end);
    if (!block) {  // cannot be: the range it left is free again
      why = "the job's window lost a range it had just freed";
      return nullptr;
    }
  }
  const auto [first, last] = pages_of(block->offset, block->size);
  // The range's pages are taken before any page is hidden to make room, so
  // none of them is.
  std::vector<uint64_t> missing;
  for (uint64_t p = first; p <= last; ++p) {
    if (w.touching[p]++ == 0 && w.chunk[p]) --idle_shown_;
    if (!w.chunk[p]) missing.push_back(p);
  }
  auto undo = [&] {
    for (uint64_t p = first; p <= last; ++p) {
      if (--w.touching[p] == 0 && w.chunk[p]) ++idle_shown_;
    }
    w.blocks.free(block->offset);
  };
  std::optional<std::vector<uint64_t>> chunks;
  size_t k = 0;  // chunks[k..] are not shown yet
  try {
    if (!missing.empty()) {
      const uint64_t held_before = pages_.held_bytes();
      chunks = free_only ? pages_.take_free(missing.size()) : pages_.take(missing.size(), why);
      if (!chunks && !free_only && idle_shown_ > 0 && !pages_.lost()) {
        hide_idle(missing.size() - std::min<uint64_t>(missing.size(), pages_.free_pages()),
                  first, last);
        chunks = pages_.take(missing.size(), why);
      }
      if (chunks && pages_.held_bytes() > held_before) {
        spdlog::debug("job memory: {} more leased for {} (pages missing {}, live {}, held {}, "
                      "idle shown pages {})",
                      format_bytes(pages_.held_bytes() - held_before), format_bytes(need),
                      missing.size(), format_bytes(live_), format_bytes(pages_.held_bytes()),
                      idle_shown_);
      }
      if (!chunks) {
        undo();
        return nullptr;
      }
      while (k < missing.size()) {  // runs of adjacent pages: one mapping call each
        size_t end = k + 1;
        while (end < missing.size() && missing[end] == missing[end - 1] + 1) ++end;
        w.pages->show(missing[k], std::vector<uint64_t>(chunks->begin() + k, chunks->begin() + end));
        for (size_t j = k; j < end; ++j) w.chunk[missing[j]] = (*chunks)[j] + 1;
        w.shown_end = std::max(w.shown_end, missing[end - 1] + 1);
        shown_ += end - k;
        pages_mapped_ += end - k;
        k = end;
      }
    }
    void* ptr = w.pages->base() + block->offset;
    placements_.emplace(ptr, Placement{block->offset, block->size});
    live_ += block->size;
    pages_.settle();
    return ptr;
  } catch (...) {
    // A fence that reports a device fault, a mapping call refused: the
    // range and its pages as before (pages shown meanwhile stay, idle).
    if (chunks) {
      for (size_t j = k; j < chunks->size(); ++j) pages_.give((*chunks)[j]);
    }
    undo();
    throw;
  }
}

uint64_t PagedResource::hide_idle(uint64_t want, uint64_t near_first, uint64_t near_last,
                                  bool spare) {
  if (idle_shown_ == 0) return 0;
  fence();
  ++trims_;
  Window& w = *window_;
  std::vector<uint64_t> idle;
  idle.reserve(idle_shown_);
  for (uint64_t p = 0; p < w.chunk.size(); ++p) {
    if (w.chunk[p] && !w.touching[p]) idle.push_back(p);
  }
  const uint64_t rest = idle.size() - std::min<uint64_t>(want, idle.size());
  const uint64_t n = std::min<uint64_t>(idle.size(), want + (spare ? rest / 2 : 0));
  if (n < idle.size()) {
    auto distance = [&](uint64_t p) {
      return p < near_first ? near_first - p : p > near_last ? p - near_last : 0;
    };
    std::nth_element(idle.begin(), idle.begin() + n, idle.end(),
                     [&](uint64_t a, uint64_t b) { return distance(a) > distance(b); });
    idle.resize(n);
    std::sort(idle.begin(), idle.end());
  }
  uint64_t hidden = 0;
  for (size_t k = 0; k < idle.size();) {  // runs of adjacent pages: one unmapping call each
    size_t end = k + 1;
    while (end < idle.size() && idle[end] == idle[end - 1] + 1) ++end;
    const bool all = w.pages->hide(idle[k], end - k);
    for (size_t j = k; j < end; ++j) {
      // A page the backend could not unmap keeps its chunk: never given
      // away while this process may still reach it.
      if (!all && w.pages->shown(idle[j])) continue;
      pages_.give(w.chunk[idle[j]] - 1);
      w.chunk[idle[j]] = 0;
      ++hidden;
    }
    k = end;
  }
  shown_ -= hidden;
  idle_shown_ -= hidden;
  return hidden;
}

[[noreturn]] void PagedResource::out_of_memory(uint64_t bytes, const std::string& why,
                                                bool permanent) {
  const uint64_t held = pages_.held_bytes();
  std::string where;
  if (window_) {
    where = " on " + std::to_string(shown_ - idle_shown_) + " pages of " +
            format_bytes(window_->pages->page_size());
  }
  throw OutOfMemoryError("out of memory: cannot allocate " + format_bytes(bytes) + ": " + why +
                             " (in use " + format_bytes(live_) + where + ", cached " +
                             format_bytes(held - std::min(held, live_)) + ", budget " +
                             (pages_.budget() ? format_bytes(pages_.budget()) : "none") + ")",
                         bytes, permanent);
}

void* PagedResource::allocate(uint64_t bytes, StreamRef) {
  if (bytes == 0) throw std::invalid_argument("allocation of 0 bytes");
  const uint64_t need = align_up(bytes, opt_.granularity);
  std::lock_guard lock(mu_);
  if (need == 0) out_of_memory(bytes, "the size overflows", true);
  std::string why;
  if (!open_window(why)) out_of_memory(bytes, why, pages_.lost());
  // A range of `need` bytes touches at least this many pages: more than the
  // budget or the pool holds never fits, whatever is freed.
  const PoolDescriptor& pool = pages_.mapping()->descriptor();
  const uint64_t pages = (need - 1) / pool.alignment + 1;
  if (pages > pool.chunk_count()) {
    out_of_memory(bytes, "larger than the device's whole pool (" + format_bytes(pool.size) + ")",
                  true);
  }
  if (pages_.budget() && pages > pages_.budget() / pool.alignment) {
    out_of_memory(bytes, "it needs " + std::to_string(pages) + " pages of " +
                             format_bytes(pool.alignment) + " and the budget holds " +
                             std::to_string(pages_.budget() / pool.alignment),
                  true);
  }
  if (void* p = place(need, false, why)) return p;
  const std::string advice = pages_.advice(need);
  out_of_memory(bytes, advice.empty() ? why : why + "; " + advice, pages_.lost());
}

void* PagedResource::allocate_if_free(uint64_t bytes, StreamRef) {
  const uint64_t need = align_up(bytes, opt_.granularity);
  if (bytes == 0 || need == 0) return nullptr;
  std::lock_guard lock(mu_);
  if (!window_) return nullptr;
  std::string why;
  return place(need, true, why);
}

void PagedResource::deallocate(void* ptr, uint64_t, StreamRef stream) noexcept {
  std::lock_guard lock(mu_);
  auto it = placements_.find(ptr);
  if (it == placements_.end()) {
    spdlog::error("a job's memory resource: free of unknown pointer {}", ptr);
    return;
  }
  const Placement pl = it->second;
  placements_.erase(it);
  Window& w = *window_;
  w.blocks.free(pl.offset);
  const auto [first, last] = pages_of(pl.offset, pl.size);
  for (uint64_t p = first; p <= last; ++p) {
    if (--w.touching[p] == 0 && w.chunk[p]) ++idle_shown_;
  }
  live_ -= pl.size;
  freed_on_.insert(stream);
}

uint64_t PagedResource::release_cached() {
  std::lock_guard lock(mu_);
  if (window_) hide_idle(UINT64_MAX);
  return pages_.release_free();
}

uint64_t PagedResource::make_room(uint64_t bytes) {
  std::lock_guard lock(mu_);
  const uint64_t need = align_up(bytes, opt_.granularity);
  if (!window_ || need == 0 || pages_.lost()) return 0;
  // The free range that lacks the fewest pages (where the allocation will
  // land): only the pages it lacks beyond the free chunks are hidden, the
  // farthest from it first, so a range that is mostly shown costs a few
  // mapping calls rather than hiding and showing every idle page. When
  // the idle pages outside it are too few, hiding would reach its own
  // (which it would then lack too): every idle page is hidden instead, and
  // the allocation lands where the fewest pages are needed in all.
  const std::optional<uint64_t> at = fewer_unshown(need, UINT64_MAX, /*inside=*/!from_top(need));
  if (!at) return 0;  // no free range that large: the allocation says so
  const uint64_t missing = unshown(*at, need), free = pages_.free_pages();
  if (missing <= free) return 0;
  const auto [first, last] = pages_of(*at, need);
  uint64_t idle_outside = 0;
  const Window& w = *window_;
  for (uint64_t p = 0; p < w.chunk.size(); ++p) {
    idle_outside += w.chunk[p] && !w.touching[p] && (p < first || p > last);
  }
  if (missing - free > idle_outside) return hide_idle(UINT64_MAX);
  return hide_idle(missing - free, first, last, /*spare=*/false);
}

bool PagedResource::allow_patient_growth() {
  std::lock_guard lock(mu_);
  return pages_.allow_patient_growth();
}

void PagedResource::disarm_patient_growth() {
  std::lock_guard lock(mu_);
  pages_.settle();
}

PagedResource::Stats PagedResource::stats() const {
  std::lock_guard lock(mu_);
  Stats s;
  s.held_bytes = pages_.held_bytes();
  s.peak_held_bytes = pages_.peak_held_bytes();
  s.live_bytes = live_;
  s.shown_pages = shown_;
  s.leases = pages_.lease_count();
  s.pages_mapped = pages_mapped_;
  s.trims = trims_;
  return s;
}

}  // namespace leasehold
