#include "torch_plugin/session_leases.h"

#include <algorithm>
#include <cstddef>
#include <iterator>
#include <utility>

#include "torch_plugin/messages.h"

namespace leasehold::torch_plugin {

namespace {
thread_local bool needed_growth = false;
}  // namespace

NeededGrowth::NeededGrowth() : was_(needed_growth) { needed_growth = true; }
NeededGrowth::~NeededGrowth() { needed_growth = was_; }
bool NeededGrowth::active() { return needed_growth; }

SessionLeases::SessionLeases(lh_session* session, uint64_t page, uint64_t window_bytes,
                             uint64_t guaranteed, uint64_t piece_bytes, LostFn on_lost)
    : session_(session),
      page_(page),
      window_bytes_((window_bytes + page - 1) / page * page),
      piece_(piece_bytes == 0 ? UINT64_MAX / page * page : std::max(page, piece_bytes / page * page)),
      on_lost_(std::move(on_lost)),
      growth_(guaranteed) {}

SessionLeases::~SessionLeases() {
  if (window_) lh_window_close(window_);  // hides every page it shows
  std::vector<lh_lease*> all;
  for (auto& [key, h] : held_) all.push_back(h.lease);
  release_leases(all);
}

LeaseSource::Result SessionLeases::failure(lh_status st, const std::string& what,
                                           std::string* why, const std::string& detail) {
  *why = what + std::string(lh_status_name(st)) + ": " + (detail.empty() ? last_error() : detail);
  switch (st) {
    case LH_ERR_NO_SPACE:
    case LH_ERR_TIMEOUT:
    case LH_ERR_TOO_LARGE:
      return Result::kRefused;
    case LH_ERR_SESSION_LOST:
      if (on_lost_) on_lost_(*why);
      return Result::kFailed;
    default:
      return Result::kFailed;
  }
}

LeaseSource::Result SessionLeases::acquire(uint64_t bytes, bool last_resort, Lease* out,
                                           std::string* why) {
  const uint64_t n = (bytes + page_ - 1) / page_;
  uint64_t first = 0;
  std::vector<PageRef> pages;
  {
    std::lock_guard lk(mu_);
    if (!window_) {
      lh_status st = lh_window_open(session_, window_bytes_, &window_);
      if (st != LH_OK) {
        window_ = nullptr;
        return failure(st, "reserving the allocator's address space: ", why);
      }
      free_runs_[0] = window_bytes_ / page_;
    }
    if (!take_addresses(n, &first)) {
      *why = "the allocator's " + format_bytes(window_bytes_) + " of address space have no " +
             format_bytes(n * page_) + " run left (it is cut by unbacked pages of live segments)";
      return Result::kRefused;
    }
    // Free pages first: memory the job holds already.
    take_from_stock(n, &pages);
  }
  // The rest in pieces, each its own lease (see the header).
  std::vector<lh_lease*> granted;
  if (pages.size() < n) {
    const uint64_t bytes = (n - pages.size()) * page_;
    lh_session_stats ss{};
    const bool known = lh_session_stats_get(session_, &ss) == LH_OK;
    const auto now = GrowthRule::Clock::now();
    GrowthRule::Ask ask;
    {
      std::lock_guard lk(mu_);
      ask = growth_.ask(ss.leased_bytes, known, bytes, last_resort, NeededGrowth::active(), now);
    }
    lh_status st = ask.held_back ? LH_ERR_NO_SPACE : LH_OK;
    std::string detail;
    if (ask.held_back) {
      detail = "growth past the guaranteed share " + format_bytes(growth_.guaranteed()) +
               " was refused less than " + std::to_string(GrowthRule::kBackoff.count()) +
               " ms ago";
    }
    // Each piece waits as the rule says: the coordinator's default wait
    // (within the share, or a needed lease) or not at all (growth).
    for (uint64_t left = bytes; st == LH_OK && left > 0;) {
      lh_lease* lease = nullptr;
      const uint64_t piece = std::min(left, piece_);
      st = lh_lease_acquire(session_, piece, ask.wait_ms, ask.needed ? 1 : 0, &lease);
      if (st != LH_OK) break;
      granted.push_back(lease);
      const uint64_t size = lh_lease_size(lease);
      if (size < piece || size % page_ != 0) {
        st = LH_ERR_INTERNAL;
        detail = "the coordinator granted " + std::to_string(size) + " bytes for " +
                 std::to_string(piece) + " (pages of " + std::to_string(page_) + ")";
        break;
      }
      left -= std::min(left, size);
    }
    if (st != LH_OK) {
      Result r = failure(st, "", why, detail);
      release_leases(granted);  // the pieces granted before the refusal
      std::lock_guard lk(mu_);
      if (st == LH_ERR_NO_SPACE) growth_.refused_for_space(ask, now);
      for (const PageRef& ref : pages) to_stock(ref);
      give_addresses(first, n);
      return r;
    }
  }
  std::vector<lh_lease*> unused;
  lh_status st = LH_OK;
  std::string show_error;
  {
    std::lock_guard lk(mu_);
    for (lh_lease* lease : granted) {
      const uint64_t key = next_key_++;
      Held& h = held_[key];
      h.lease = lease;
      h.shown.assign(lh_lease_size(lease) / page_, false);
      for (uint64_t k = 0; k < h.shown.size(); ++k) {
        if (pages.size() < n) {
          pages.emplace_back(key, k);
          h.shown[k] = true;
          ++h.shown_count;
        } else {
          stock_.emplace(key, k);
        }
      }
    }
    bool hidden = true;
    st = show(first, pages, &hidden, &show_error);
    if (st == LH_OK) {
      const uint64_t id = next_id_++;
      segments_[id] = Segment{first, pages};
      out->base = static_cast<std::byte*>(lh_window_base(window_)) + first * page_;
      out->size = n * page_;
      out->id = id;
      return Result::kGranted;
    }
    if (hidden) {
      for (const PageRef& ref : pages) to_stock(ref);
      give_addresses(first, n);
      unused = take_unused();
    } else {
      // Some page may still show: the pages and the addresses stay out of
      // use (a segment nobody has), and their leases held.
      segments_[next_id_++] = Segment{first, pages};
    }
  }
  Result r = failure(st, "showing a lease's pages: ", why, show_error);
  release_leases(unused);
  return r;
}

void SessionLeases::release(uint64_t id) noexcept {
  std::vector<lh_lease*> unused;
  {
    std::lock_guard lk(mu_);
    auto it = segments_.find(id);
    if (it == segments_.end()) {
      print_line("leasehold: giving back segment " + std::to_string(id) + ", which is not held");
      return;
    }
    Segment& seg = it->second;
    if (lh_window_hide(window_, seg.first * page_, seg.pages.size() * page_) != LH_OK) {
      // Its pages may still show their memory: they and their leases stay.
      print_line("leasehold: giving a segment back: " + last_error());
      return;
    }
    for (const PageRef& ref : seg.pages) {
      if (ref != kNone) to_stock(ref);
    }
    give_addresses(seg.first, seg.pages.size());
    segments_.erase(it);
    unused = take_unused();
  }
  release_leases(unused);
}

void SessionLeases::unback(uint64_t id, uint64_t offset, uint64_t bytes) noexcept {
  std::lock_guard lk(mu_);
  auto it = segments_.find(id);
  if (it == segments_.end() || offset % page_ || bytes % page_ ||
      (offset + bytes) / page_ > it->second.pages.size()) {
    print_line("leasehold: unbacking pages the allocator does not hold (segment " +
               std::to_string(id) + ")");
    return;
  }
  Segment& seg = it->second;
  if (lh_window_hide(window_, seg.first * page_ + offset, bytes) != LH_OK) {
    // Which pages still show is not known: they all stay the segment's,
    // held, until it is released (whose hide tries them all again).
    print_line("leasehold: unbacking free pages: " + last_error() +
               "; their memory stays held until the segment goes");
    return;
  }
  for (uint64_t k = offset / page_; k < (offset + bytes) / page_; ++k) {
    if (seg.pages[k] != kNone) to_stock(seg.pages[k]);
    seg.pages[k] = kNone;
  }
}

uint64_t SessionLeases::give_back_unused() noexcept {
  std::vector<lh_lease*> unused;
  {
    std::lock_guard lk(mu_);
    unused = take_unused();
  }
  return release_leases(unused);
}

// ---- pages, leases and addresses -------------------------------------------------

lh_status SessionLeases::show(uint64_t first, const std::vector<PageRef>& pages, bool* hidden,
                              std::string* error) {
  *hidden = true;
  uint64_t k = 0;
  while (k < pages.size()) {
    uint64_t run = 1;
    while (k + run < pages.size() && pages[k + run].first == pages[k].first &&
           pages[k + run].second == pages[k].second + run) {
      ++run;
    }
    lh_status st = lh_window_show(window_, (first + k) * page_, held_.at(pages[k].first).lease,
                                  pages[k].second * page_, run * page_);
    if (st != LH_OK) {
      *error = last_error();  // before the hide's own message
      if (k) *hidden = lh_window_hide(window_, first * page_, k * page_) == LH_OK;
      return st;
    }
    k += run;
  }
  return LH_OK;
}

void SessionLeases::take_from_stock(uint64_t n, std::vector<PageRef>* pages) {
  while (pages->size() < n && !stock_.empty()) {
    // The lease with the fewest free pages: one mostly free is left to
    // become wholly free and go back.
    uint64_t best = 0, best_free = UINT64_MAX;
    for (const auto& [key, h] : held_) {
      const uint64_t free = h.shown.size() - h.shown_count;
      if (free != 0 && free < best_free) {
        best = key;
        best_free = free;
      }
    }
    auto found = held_.find(best);
    if (found == held_.end()) break;  // no lease has free pages: the stock is out of step
    Held& h = found->second;
    const size_t had = pages->size();
    for (auto it = stock_.lower_bound({best, 0});
         pages->size() < n && it != stock_.end() && it->first == best;) {
      pages->push_back(*it);
      h.shown[it->second] = true;
      ++h.shown_count;
      it = stock_.erase(it);
    }
    if (pages->size() == had) break;  // its free pages are not in the stock: as above
  }
}

void SessionLeases::to_stock(const PageRef& ref) {
  Held& h = held_.at(ref.first);
  h.shown[ref.second] = false;
  --h.shown_count;
  stock_.insert(ref);
}

std::vector<lh_lease*> SessionLeases::take_unused() {
  std::vector<lh_lease*> out;
  for (auto it = held_.begin(); it != held_.end();) {
    if (it->second.shown_count != 0) {
      ++it;
      continue;
    }
    const uint64_t key = it->first;
    stock_.erase(stock_.lower_bound({key, 0}), stock_.lower_bound({key + 1, 0}));
    out.push_back(it->second.lease);
    it = held_.erase(it);
  }
  return out;
}

uint64_t SessionLeases::release_leases(const std::vector<lh_lease*>& leases) noexcept {
  uint64_t bytes = 0;
  for (lh_lease* l : leases) {
    const uint64_t size = lh_lease_size(l);
    lh_status st = lh_lease_release(l);
    if (st == LH_OK) {
      bytes += size;
    } else if (st == LH_ERR_SESSION_LOST) {
      if (on_lost_) on_lost_("giving a lease back: " + last_error());
    } else {
      print_line(std::string("leasehold: giving a lease back: ") + lh_status_name(st) + ": " +
                 last_error());
    }
  }
  return bytes;
}

bool SessionLeases::take_addresses(uint64_t n, uint64_t* first) {
  for (auto it = free_runs_.begin(); it != free_runs_.end(); ++it) {
    if (it->second < n) continue;
    *first = it->first;
    if (it->second > n) free_runs_[it->first + n] = it->second - n;
    free_runs_.erase(it);
    return true;
  }
  return false;
}

void SessionLeases::give_addresses(uint64_t first, uint64_t n) {
  auto next = free_runs_.lower_bound(first);
  if (next != free_runs_.end() && next->first == first + n) {
    n += next->second;
    next = free_runs_.erase(next);
  }
  if (next != free_runs_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == first) {
      prev->second += n;
      return;
    }
  }
  free_runs_[first] = n;
}

}  // namespace leasehold::torch_plugin
