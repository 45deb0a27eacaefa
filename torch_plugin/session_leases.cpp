#include "torch_plugin/session_leases.h"

#include "torch_plugin/plugin_state.h"

namespace leasehold::torch_plugin {

LeaseSource::Result SessionLeases::acquire(uint64_t bytes, bool last_resort, Lease* out,
                                           std::string* why) {
  lh_lease* lease = nullptr;
  // -1: the coordinator's default wait when the pool is short.
  lh_status st = lh_lease_acquire(session_, bytes, -1, last_resort ? 1 : 0, &lease);
  if (st == LH_OK) {
    void* data = lh_lease_data(lease);
    if (data == nullptr) {
      (void)lh_lease_release(lease);
      *why = "the session was lost as the lease was granted";
      plugin_.note_lost(*why);
      return Result::kFailed;
    }
    out->base = data;
    out->size = lh_lease_size(lease);
    out->id = reinterpret_cast<uintptr_t>(lease);
    return Result::kGranted;
  }
  *why = std::string(lh_status_name(st)) + ": " + last_error();
  switch (st) {
    case LH_ERR_NO_SPACE:
    case LH_ERR_TIMEOUT:
    case LH_ERR_TOO_LARGE:
      return Result::kRefused;
    case LH_ERR_SESSION_LOST:
      plugin_.note_lost(*why);
      return Result::kFailed;
    default:
      return Result::kFailed;
  }
}

void SessionLeases::release(uint64_t id) noexcept {
  lh_status st = lh_lease_release(reinterpret_cast<lh_lease*>(id));
  if (st == LH_ERR_SESSION_LOST) {
    plugin_.note_lost("giving a lease back: " + last_error());
  } else if (st != LH_OK) {
    print_line(std::string("leasehold: giving a lease back: ") + lh_status_name(st) + ": " +
               last_error());
  }
}

}  // namespace leasehold::torch_plugin
