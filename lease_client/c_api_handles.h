// The handles of libleasehold.so's C interface (lease_client/leasehold.h)
// and the error plumbing its entry points share (c_api.cpp: sessions and
// leases; c_api_window.cpp: windows). Internal to the library. No
// exception leaves an entry point: whatever may throw runs inside
// `guarded` (or `guarded_or`), which turns it into an lh_status (or a
// fallback value) and a message in this thread's buffer.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <set>
#include <string_view>
#include <vector>

#include "lease_client/leasehold.h"
#include "lease_client/session.h"
#include "shared/chunk_window.h"

struct lh_lease;
struct lh_window;

namespace leasehold::c_api {

// Leaves `message` as this thread's lh_last_error() and returns `status`.
lh_status fail(lh_status status, std::string_view message);
const char* last_error();
lh_status status_of(leasehold::ErrorCode code);

// Runs `body`, turning whatever it throws into a status and a message.
template <typename Body>
lh_status guarded(Body&& body) noexcept {
  try {
    return body();
  } catch (const leasehold::Error& e) {
    return fail(status_of(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    return fail(LH_ERR_INTERNAL, "out of host memory");
  } catch (const std::exception& e) {
    return fail(LH_ERR_INTERNAL, e.what());
  } catch (...) {
    return fail(LH_ERR_INTERNAL, "unknown exception");
  }
}

// For the entry points that return a value rather than a status: `body`'s
// result, or `otherwise` (and guarded's message) when it throws.
template <typename T, typename Body>
T guarded_or(T otherwise, Body&& body) noexcept {
  T result = otherwise;
  guarded([&] {
    result = body();
    return LH_OK;
  });
  return result;
}

// The leases a session handed out and not yet released: its statistics.
// Shared with the leases, which may outlive the session's handle.
struct LeaseSet {
  std::mutex mu;
  std::set<const lh_lease*> leases;  // GUARDED_BY(mu)
  std::set<lh_window*> windows;      // GUARDED_BY(mu): open, of its registrations
};

}  // namespace leasehold::c_api

struct lh_session {
  std::unique_ptr<leasehold::AgentSession> session;
  std::shared_ptr<leasehold::c_api::LeaseSet> leases = std::make_shared<leasehold::c_api::LeaseSet>();
  uint64_t budget_bytes = 0;
};

struct lh_lease {
  leasehold::Lease lease;
  std::shared_ptr<leasehold::c_api::LeaseSet> set;  // the granting session's
  // Pages of it shown in windows now: it is not released while any is.
  std::atomic<uint64_t> shown{0};
};

// A ChunkWindow and which lease each page shows (so that hiding counts the
// lease's shown pages down; a lease is never released while it has any,
// so the pointers stay valid).
struct lh_window {
  std::shared_ptr<leasehold::c_api::LeaseSet> set;  // the session's
  std::unique_ptr<leasehold::ChunkWindow> pages;
  std::mutex mu;
  std::vector<lh_lease*> shown_by;  // GUARDED_BY(mu); per page
};
