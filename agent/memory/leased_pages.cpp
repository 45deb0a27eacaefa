#include "agent/memory/leased_pages.h"

#include <spdlog/spdlog.h>

#include <algorithm>

#include "shared/units.h"

namespace leasehold {

LeasedPages::LeasedPages(AgentSession& session, LeasedPagesOptions options)
    : session_(session), opt_(options) {}

LeasedPages::~LeasedPages() {
  for (Held& h : leases_) {
    if (!h.lease.held() || h.lease.lost()) continue;
    try {
      h.lease.release();
    } catch (const std::exception& e) {
      spdlog::warn("giving back lease {}: {}", h.lease.id(), e.what());
    }
  }
}

bool LeasedPages::bind(std::string& why) {
  std::shared_ptr<PoolMapping> now = session_.current_mapping();
  if (!mapping_) {
    if (!now) {
      why = "the agent is not registered with the coordinator";
      return false;
    }
    mapping_ = std::move(now);
    page_size_ = mapping_->descriptor().alignment;
    return true;
  }
  if (now != mapping_) {
    why = "the coordinator session was lost, and the job's memory with it";
    return false;
  }
  return true;
}

std::optional<std::vector<uint64_t>> LeasedPages::take(uint64_t n, std::string& why) {
  last_refusal_.reset();  // what this call is refused, not an earlier one
  patient_refused_ = false;
  if (!bind(why)) return std::nullopt;
  if (free_ < n && !grow(n - free_, why)) return std::nullopt;
  return pop(n);
}

std::optional<std::vector<uint64_t>> LeasedPages::take_free(uint64_t n) {
  if (free_ < n) return std::nullopt;
  std::string why;
  if (!bind(why)) return std::nullopt;
  return pop(n);
}

std::vector<uint64_t> LeasedPages::pop(uint64_t n) {
  std::vector<uint64_t> out;
  out.reserve(n);
  while (out.size() < n) {
    // From the lease with the fewest free pages, its lowest first: the
    // others (and the tails) stay free, to be given back whole.
    Held* from = nullptr;
    for (Held& h : leases_) {
      if (h.free && (!from || h.free < from->free)) from = &h;
    }
    for (uint64_t i = 0; i < from->taken.size() && out.size() < n; ++i) {
      if (from->taken[i]) continue;
      from->taken[i] = true;
      --from->free;
      --free_;
      out.push_back(from->first + i);
    }
  }
  return out;
}

void LeasedPages::give(uint64_t chunk) {
  for (Held& h : leases_) {
    if (chunk < h.first || chunk - h.first >= h.taken.size()) continue;
    if (!h.taken[chunk - h.first]) {
      spdlog::error("page {} given back twice", chunk);
      return;
    }
    h.taken[chunk - h.first] = false;
    ++h.free;
    ++free_;
    return;
  }
  spdlog::error("page {} given back is in none of the job's leases", chunk);
}

bool LeasedPages::growth_held() const {
  return opt_.guaranteed_bytes && std::chrono::steady_clock::now() < no_growth_until_;
}

bool LeasedPages::grow(uint64_t pages, std::string& why) {
  const uint64_t need = pages * page_size_;
  // While the coordinator holds growth back, the budget is what is held
  // (at least the guaranteed share) — unless this is the last resort.
  const bool patient = patience_ == Patience::Armed;
  const bool held_back = !patient && growth_held();
  uint64_t budget = opt_.budget_bytes;
  if (held_back) {
    const uint64_t allowed = std::max(opt_.guaranteed_bytes, held_);
    budget = budget ? std::min(budget, allowed) : allowed;
  }
  if (budget && (held_ > budget || need > budget - held_)) {
    why = held_back ? "growth past the job's guaranteed share is held back by the coordinator"
                    : "the job's memory budget is exhausted";
    return false;
  }
  // The last resort asks for what it needs, not a usual lease: that request
  // may make others give growth back.
  uint64_t usual = patient ? need : align_up(std::max(opt_.lease_bytes, need), page_size_);
  if (budget) usual = std::min(usual, align_down(budget - held_, page_size_));
  // What fits the guaranteed share is asked for within it: a usual lease
  // reaching past it would be growth, refused at once when the pool is full.
  const uint64_t share = opt_.guaranteed_bytes;
  if (share && held_ + need <= share) {
    usual = std::min(usual, std::max(need, align_down(share - held_, page_size_)));
  }
  if (lease(usual, patient, why)) return true;
  // The pool may have room for what is needed, if not for a usual lease
  // (unless growth was held back before this call).
  auto no_room = [&] {
    return last_refusal_ == ErrorCode::NoSpace || last_refusal_ == ErrorCode::TooLarge;
  };
  if (!no_room() || held_back) return false;
  if (usual > need) {
    if (lease(need, patient, why)) return true;
    if (!no_room()) return false;
  }
  return lease_pieces(need, patient, why);
}

bool LeasedPages::lease_pieces(uint64_t need, bool patient, std::string& why) {
  // Pages need not be contiguous in the pool: free chunks scattered between
  // other tenants' leases serve as well, asked for in halves, then quarters,
  // down to single pages, without waiting. All or nothing.
  const size_t before = leases_.size();
  uint64_t got = 0;
  uint64_t piece = std::max(page_size_, align_down(need / 2, page_size_));
  std::string refusal;
  while (got < need) {
    const uint64_t ask = std::min(piece, align_up(need - got, page_size_));
    const uint64_t held_before = held_;
    if (lease(ask, patient, refusal, std::chrono::milliseconds(0))) {
      got += held_ - held_before;
      continue;
    }
    // Growth the coordinator holds back is held back in pieces too.
    if (last_refusal_ != ErrorCode::NoSpace || piece == page_size_ || growth_held()) break;
    piece = std::max(page_size_, align_down(piece / 2, page_size_));
  }
  if (got >= need) return true;
  while (leases_.size() > before) {  // nothing of them was taken yet
    Held& h = leases_.back();
    held_ -= h.lease.size();
    free_ -= h.free;
    try {
      h.lease.release();
    } catch (const std::exception& e) {
      spdlog::warn("giving back lease {}: {}", h.lease.id(), e.what());
    }
    leases_.pop_back();
  }
  why += "; " + format_bytes(got) + " of it was free in pieces";
  return false;
}

bool LeasedPages::lease(uint64_t bytes, bool patient, std::string& why,
                        std::optional<std::chrono::milliseconds> wait_for) {
  const bool growth = opt_.guaranteed_bytes && held_ + bytes > opt_.guaranteed_bytes;
  std::optional<std::chrono::milliseconds> wait = opt_.lease_wait;
  if (opt_.guaranteed_bytes && (!growth || patient)) wait = opt_.guaranteed_wait;
  if (wait_for) wait = wait_for;
  if (growth && patient) patience_ = Patience::Used;
  try {
    Lease l = session_.acquire(bytes, LeaseEnd::High, wait, growth && patient);
    if (session_.current_mapping() != mapping_) {
      // Granted by a session that began after this one was lost.
      why = "the coordinator session was lost, and the job's memory with it";
      return false;  // ~Lease gives it back
    }
    Held h;
    h.first = l.offset() / page_size_;
    h.taken.assign(l.size() / page_size_, false);
    h.free = h.taken.size();
    h.lease = std::move(l);
    held_ += h.lease.size();
    peak_held_ = std::max(peak_held_, held_);
    free_ += h.free;
    leases_.push_back(std::move(h));
    last_refusal_.reset();
    return true;
  } catch (const Error& e) {
    why = std::string("the coordinator refused a lease of ") + format_bytes(bytes) + ": " +
          e.what();
    last_refusal_ = e.code();
    if (growth && !patient) no_growth_until_ = std::chrono::steady_clock::now() + opt_.growth_backoff;
    patient_refused_ = growth && patient &&
                       (e.code() == ErrorCode::NoSpace || e.code() == ErrorCode::Timeout);
    return false;
  }
}

uint64_t LeasedPages::release_free() {
  uint64_t released = 0;
  for (auto it = leases_.begin(); it != leases_.end();) {
    Held& h = *it;
    const uint64_t count = h.taken.size();
    if (h.free == count) {
      try {
        h.lease.release();
      } catch (const std::exception& e) {
        // Not held any more either way (Lease::release).
        spdlog::warn("giving back lease {}: {}", h.lease.id(), e.what());
      }
      held_ -= count * page_size_;
      free_ -= count;
      released += count * page_size_;
      it = leases_.erase(it);
      continue;
    }
    uint64_t tail = 0;
    while (tail < count && !h.taken[count - 1 - tail]) ++tail;
    if (tail) {
      try {
        session_.resize(h.lease, (count - tail) * page_size_);
        h.taken.resize(count - tail);
        h.free -= tail;
        free_ -= tail;
        held_ -= tail * page_size_;
        released += tail * page_size_;
      } catch (const std::exception& e) {
        spdlog::warn("shrinking lease {}: {}", h.lease.id(), e.what());
      }
    }
    ++it;
  }
  return released;
}

bool LeasedPages::allow_patient_growth() {
  // Growth past the share is possible only below the budget.
  const bool room = !opt_.budget_bytes || opt_.guaranteed_bytes < opt_.budget_bytes;
  if (!opt_.guaranteed_bytes || !room || patience_ != Patience::Off) return false;
  patience_ = Patience::Armed;
  return true;
}

std::string LeasedPages::advice(uint64_t need) const {
  if (!patient_refused_ || held_ + need <= opt_.guaranteed_bytes) return "";
  // What it cannot spill does not fit its guaranteed share, and the pool
  // had no room past it: only a larger share makes this sure.
  return "the job needs more than its guaranteed share (memory_min " +
         format_bytes(opt_.guaranteed_bytes) + ") here: raise memory_min";
}

}  // namespace leasehold
