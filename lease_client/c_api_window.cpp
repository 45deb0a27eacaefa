// lh_window_*: windows of address space showing pages of a session's
// leases (lease_client/leasehold.h).
#include <string>
#include <vector>

#include "lease_client/c_api_handles.h"

namespace {

using namespace leasehold::c_api;
using leasehold::Lease;

// A range a window call was given that is not inside the window.
lh_status outside_window(const char* fn, uint64_t offset, uint64_t bytes, uint64_t window_bytes) {
  return fail(LH_ERR_INVALID_ARGUMENT, std::string(fn) + ": [" + std::to_string(offset) + ", +" +
                                           std::to_string(bytes) + ") is outside the window of " +
                                           std::to_string(window_bytes) + " bytes");
}

}  // namespace

extern "C" {

lh_status lh_window_open(lh_session* session, uint64_t size, lh_window** window) noexcept {
  if (!window) return fail(LH_ERR_INVALID_ARGUMENT, "lh_window_open: window is NULL");
  *window = nullptr;
  if (!session) return fail(LH_ERR_INVALID_ARGUMENT, "lh_window_open: session is NULL");
  if (size == 0) return fail(LH_ERR_INVALID_ARGUMENT, "lh_window_open: size is 0");
  return guarded([&] {
    std::shared_ptr<leasehold::PoolMapping> mapping = session->session->current_mapping();
    if (!mapping) {
      return fail(LH_ERR_SESSION_LOST, "lh_window_open: the session is not registered now");
    }
    const uint64_t page = mapping->descriptor().alignment;
    const uint64_t pages = size / page + (size % page ? 1 : 0);
    auto w = std::make_unique<lh_window>();
    w->pages = leasehold::open_window(std::move(mapping), pages);
    w->shown_by.assign(pages, nullptr);
    w->set = session->leases;
    std::lock_guard lock(w->set->mu);
    w->set->windows.insert(w.get());
    *window = w.release();
    return LH_OK;
  });
}

void* lh_window_base(const lh_window* window) noexcept {
  return window ? static_cast<void*>(window->pages->base()) : nullptr;
}

uint64_t lh_window_size(const lh_window* window) noexcept {
  return window ? window->pages->page_count() * window->pages->page_size() : 0;
}

uint64_t lh_window_page_size(const lh_window* window) noexcept {
  return window ? window->pages->page_size() : 0;
}

lh_status lh_window_show(lh_window* window, uint64_t offset, const lh_lease* lease,
                         uint64_t lease_offset, uint64_t bytes) noexcept {
  if (!window || !lease) return fail(LH_ERR_INVALID_ARGUMENT, "lh_window_show: a NULL argument");
  return guarded([&] {
    const leasehold::ChunkWindow& w = *window->pages;
    const uint64_t page = w.page_size();
    const uint64_t window_bytes = w.page_count() * page;
    if (offset % page || lease_offset % page || bytes % page || bytes == 0) {
      return fail(LH_ERR_INVALID_ARGUMENT,
                  "lh_window_show: offsets and size must be multiples of the page size, " +
                      std::to_string(page) + " bytes, and the size not 0");
    }
    if (offset > window_bytes || bytes > window_bytes - offset) {
      return outside_window("lh_window_show", offset, bytes, window_bytes);
    }
    const Lease& l = lease->lease;
    if (!l.held() || l.lost()) {
      return fail(LH_ERR_SESSION_LOST, "lh_window_show: lease " + std::to_string(l.id()) +
                                           " is lost (its session registered again or closed)");
    }
    if (lease_offset > l.size() || bytes > l.size() - lease_offset) {
      return fail(LH_ERR_INVALID_ARGUMENT, "lh_window_show: [" + std::to_string(lease_offset) +
                                               ", +" + std::to_string(bytes) +
                                               ") is outside lease " + std::to_string(l.id()) +
                                               " of " + std::to_string(l.size()) + " bytes");
    }
    if (l.mapping() != w.source()) {
      return fail(LH_ERR_SESSION_LOST, "lh_window_show: lease " + std::to_string(l.id()) +
                                           " is of another registration than the window");
    }
    const uint64_t first = offset / page, count = bytes / page;
    std::vector<uint64_t> chunks(count);
    for (uint64_t k = 0; k < count; ++k) chunks[k] = (l.offset() + lease_offset) / page + k;
    std::lock_guard lock(window->mu);
    for (uint64_t k = 0; k < count; ++k) {
      if (window->shown_by[first + k]) {
        return fail(LH_ERR_INVALID_ARGUMENT, "lh_window_show: page " + std::to_string(first + k) +
                                                 " of the window shows a lease's memory already");
      }
    }
    window->pages->show(first, chunks);
    auto* owner = const_cast<lh_lease*>(lease);
    for (uint64_t k = 0; k < count; ++k) window->shown_by[first + k] = owner;
    owner->shown += count;
    return LH_OK;
  });
}

lh_status lh_window_hide(lh_window* window, uint64_t offset, uint64_t bytes) noexcept {
  if (!window) return fail(LH_ERR_INVALID_ARGUMENT, "lh_window_hide: window is NULL");
  return guarded([&] {
    leasehold::ChunkWindow& w = *window->pages;
    const uint64_t page = w.page_size();
    const uint64_t window_bytes = w.page_count() * page;
    if (offset % page || bytes % page) {
      return fail(LH_ERR_INVALID_ARGUMENT,
                  "lh_window_hide: offset and size must be multiples of the page size, " +
                      std::to_string(page) + " bytes");
    }
    if (offset > window_bytes || bytes > window_bytes - offset) {
      return outside_window("lh_window_hide", offset, bytes, window_bytes);
    }
    std::lock_guard lock(window->mu);
    const uint64_t first = offset / page, count = bytes / page;
    const bool ok = w.hide(first, count);
    for (uint64_t p = first; p < first + count; ++p) {
      if (window->shown_by[p] && !w.shown(p)) {
        --window->shown_by[p]->shown;
        window->shown_by[p] = nullptr;
      }
    }
    if (!ok) {
      return fail(LH_ERR_INTERNAL,
                  "lh_window_hide: the backend failed to unmap some page (see the log); it "
                  "still shows its lease's memory");
    }
    return LH_OK;
  });
}

void lh_window_close(lh_window* window) noexcept {
  if (!window) return;
  (void)lh_window_hide(window, 0, lh_window_size(window));
  // A page the backend could not unmap keeps its lease from being
  // released: the address space is not freed under it either.
  bool stuck = false;
  for (lh_lease* l : window->shown_by) stuck = stuck || l != nullptr;
  if (stuck) {
    (void)fail(LH_ERR_INTERNAL, "lh_window_close: pages still shown; the window is kept");
    return;
  }
  {
    std::lock_guard lock(window->set->mu);
    window->set->windows.erase(window);
  }
  delete window;
}

}  // extern "C"
