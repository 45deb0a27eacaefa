// libleasehold.so's shared-region entry points (leasehold.h): an lh_region
// is a RegionAttachment of the session's current registration.
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "lease_client/c_api_handles.h"

using leasehold::c_api::fail;
using leasehold::c_api::guarded;
using leasehold::c_api::guarded_or;

struct lh_region {
  leasehold::RegionAttachment attachment;
};

extern "C" {

lh_status lh_region_attach(lh_session* session, const char* name, uint64_t size, int flags,
                           int64_t wait_ms, lh_region** region) noexcept {
  if (!session || !name || !region) {
    return fail(LH_ERR_INVALID_ARGUMENT, "lh_region_attach: a NULL argument");
  }
  *region = nullptr;
  if (wait_ms < -1) {
    return fail(LH_ERR_INVALID_ARGUMENT,
                "lh_region_attach: wait_ms " + std::to_string(wait_ms) + " (-1, 0 or more)");
  }
  if (flags & ~(LH_REGION_CREATE | LH_REGION_REPLACE)) {
    return fail(LH_ERR_INVALID_ARGUMENT,
                "lh_region_attach: unknown flags " + std::to_string(flags));
  }
  const bool create = (flags & LH_REGION_CREATE) != 0;
  const bool replace = (flags & LH_REGION_REPLACE) != 0;
  if (replace && !create) {
    return fail(LH_ERR_INVALID_ARGUMENT, "lh_region_attach: LH_REGION_REPLACE without CREATE");
  }
  if (create && size == 0) {
    return fail(LH_ERR_INVALID_ARGUMENT,
                std::string("lh_region_attach: region '") + name + "' created with 0 bytes");
  }
  return guarded([&] {
    std::optional<std::chrono::milliseconds> wait;
    if (wait_ms >= 0) wait = std::chrono::milliseconds(wait_ms);
    auto handle = std::make_unique<lh_region>();
    try {
      handle->attachment = session->session->attach_region(name, size, create, wait, replace);
    } catch (const leasehold::Error& e) {
      if (e.code() == leasehold::ErrorCode::NoSuchRegion) return fail(LH_ERR_NOT_FOUND, e.what());
      throw;
    }
    *region = handle.release();
    return LH_OK;
  });
}

void* lh_region_data(const lh_region* region) noexcept {
  if (!region) return nullptr;
  return guarded_or<void*>(nullptr, [&]() -> void* {
    const auto& a = region->attachment;
    return a.held() && !a.lost() ? a.data() : nullptr;
  });
}

uint64_t lh_region_size(const lh_region* region) noexcept {
  return region && region->attachment.held() ? region->attachment.size() : 0;
}

int lh_region_must_fill(const lh_region* region) noexcept {
  return region && region->attachment.held() && region->attachment.must_fill() ? 1 : 0;
}

lh_status lh_region_mark_ready(lh_region* region) noexcept {
  if (!region) return fail(LH_ERR_INVALID_ARGUMENT, "lh_region_mark_ready: a NULL region");
  if (!region->attachment.held()) {
    return fail(LH_ERR_INVALID_ARGUMENT, "lh_region_mark_ready: the region is detached");
  }
  if (!region->attachment.must_fill()) {
    return fail(LH_ERR_INVALID_ARGUMENT, "lh_region_mark_ready: region '" +
                                             region->attachment.name() +
                                             "' is not this attacher's to fill (another filled it, or it is "
                                             "marked ready already)");
  }
  return guarded([&] {
    region->attachment.mark_ready();
    return LH_OK;
  });
}

lh_status lh_region_detach(lh_region* region) noexcept {
  if (!region) return LH_OK;
  std::unique_ptr<lh_region> owned(region);  // freed whatever the answer
  return guarded([&] {
    auto& a = owned->attachment;
    if (a.held() && !a.lost()) a.detach();
    return LH_OK;
  });
}

}  // extern "C"
