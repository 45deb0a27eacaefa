#include "torch_plugin/shrink_worker.h"

#include <exception>
#include <string>
#include <thread>
#include <utility>

#include "torch_plugin/plugin_state.h"

namespace leasehold::torch_plugin {
namespace {

void shrink_worker(Plugin* p) {
  for (;;) {
    std::pair<uint64_t, uint64_t> req;
    {
      std::unique_lock lk(p->shrink_mu);
      p->shrink_cv.wait(lk, [&] { return !p->shrinks.empty(); });
      req = p->shrinks.front();
      p->shrinks.pop_front();
    }
    BlockCache* cache = p->cache.load(std::memory_order_acquire);
    // What went back is what the session holds less: trimming unbacks
    // pages of leases that stay held while other pages of them show.
    lh_session_stats before{}, after{};
    const bool counted = lh_session_stats_get(p->session, &before) == LH_OK;
    std::string reason;
    try {
      // Free cached memory first; when that is not enough, spilled
      // activations free blocks (the pressure handler), which are trimmed
      // in turn once their copies completed. Enough is what the session
      // holds less, not what the trim freed: free pages of a lease that
      // other pages of still show stay leased (session_leases.h).
      uint64_t trimmed = cache->trim(req.second);
      lh_session_stats now{};
      uint64_t gone = trimmed;
      if (counted && lh_session_stats_get(p->session, &now) == LH_OK) {
        gone = before.leased_bytes > now.leased_bytes ? before.leased_bytes - now.leased_bytes : 0;
      }
      if (gone < req.second && relieve_pressure(*p, req.second - gone) > 0) {
        cache->trim(req.second - gone);
      }
    } catch (const std::exception& e) {
      reason = one_line(e.what());
    }
    const bool counted_after = counted && lh_session_stats_get(p->session, &after) == LH_OK;
    // (Approximate while other threads lease: they may move either figure.)
    uint64_t released = 0;
    if (counted_after && before.leased_bytes > after.leased_bytes) {
      released = before.leased_bytes - after.leased_bytes;
    }
    BlockCacheStats st = cache->stats();
    const uint64_t still = counted_after ? after.leased_bytes : st.leased_bytes;
    if (released < req.second && reason.empty()) {
      reason = "PyTorch holds " + format_bytes(st.in_use_bytes) + " in use; the other " +
               format_bytes(still > st.in_use_bytes ? still - st.in_use_bytes : 0) +
               " leased are pages live blocks share, free pages of leases partly in use, and "
               "blocks awaited by other streams or kept for CUDA graphs";
    }
    lh_status s = lh_session_shrink_done(p->session, req.first, released, still,
                                         reason.empty() ? nullptr : reason.c_str());
    if (s == LH_ERR_SESSION_LOST) {
      p->note_lost("answering a Shrink: " + last_error());
    } else if (s != LH_OK) {
      print_line(std::string("leasehold: answering a Shrink: ") + lh_status_name(s) + ": " +
                 last_error());
    }
  }
}

}  // namespace

void start_shrink_worker(Plugin& p) {
  // A lambda rather than shrink_worker itself: the thread's state type then
  // has no linkage, and the plug-in exports nothing but its C functions.
  std::thread([pp = &p] { shrink_worker(pp); }).detach();
}

void on_shrink(void* user, uint64_t shrink_id, uint64_t bytes) {
  auto* p = static_cast<Plugin*>(user);
  {
    std::lock_guard lk(p->shrink_mu);
    p->shrinks.emplace_back(shrink_id, bytes);
  }
  p->shrink_cv.notify_one();
}

}  // namespace leasehold::torch_plugin
