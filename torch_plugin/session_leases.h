// Leases of the job's session with the coordinator (lease_client/
// leasehold.h) as the block cache's LeaseSource (block_cache.h).
//
// A full pool, a queue that timed out and a request too large are
// refusals: the cache may give memory back and ask again. A lost session
// is a failure, and noted in the Plugin (plugin_state.h) so that every
// later allocation reports it. Thread safety: as the lease client's, any
// thread; never throws.
#pragma once

#include <cstdint>
#include <string>

#include "leasehold.h"
#include "torch_plugin/block_cache.h"

namespace leasehold::torch_plugin {

struct Plugin;

class SessionLeases final : public LeaseSource {
 public:
  // `session` and `p` must outlive it.
  SessionLeases(lh_session* session, Plugin& p) : session_(session), plugin_(p) {}

  Result acquire(uint64_t bytes, bool last_resort, Lease* out, std::string* why) override;
  // A failure is printed on standard error (a lost session is noted).
  void release(uint64_t id) noexcept override;

 private:
  lh_session* const session_;
  Plugin& plugin_;
};

}  // namespace leasehold::torch_plugin
