// Answers the coordinator's Shrink requests (the occupancy policy asking
// the job for memory back). The session's heart-beat thread delivers them
// to on_shrink, which must not block (lease_client/leasehold.h): it queues
// the request in the Plugin (plugin_state.h). The shrink worker, a detached
// thread started once the cache exists, trims the cache and answers with
// what it released and, when short, why.
#pragma once

#include <cstdint>

namespace leasehold::torch_plugin {

struct Plugin;

// Starts the shrink worker, detached: it runs for the life of the process
// (never joined: see plugin_state.h). REQUIRES: p.session is set and
// p.cache is set before a request is queued.
void start_shrink_worker(Plugin& p);
// The session's shrink handler (an lh_shrink_fn); `user` is the Plugin.
void on_shrink(void* user, uint64_t shrink_id, uint64_t bytes);

}  // namespace leasehold::torch_plugin
