#include "torch_plugin/plugin_state.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <thread>

#include "torch_plugin/cuda_streams.h"
#include "torch_plugin/session_leases.h"
#include "torch_plugin/shrink_worker.h"

namespace leasehold::torch_plugin {

// ---- the state ------------------------------------------------------------------

void Plugin::note_lost(const std::string& reason) {
  std::lock_guard lk(lost_mu);
  if (lost_reason.empty()) lost_reason = one_line(reason);
  lost.store(true, std::memory_order_release);
}

std::string Plugin::lost_message() {
  std::lock_guard lk(lost_mu);
  std::string msg = "leasehold: the job's session with the coordinator is lost (" + lost_reason +
                    "): the memory leased to it is void and the job cannot go on";
  if (!lost_printed) {
    lost_printed = true;
    print_line(msg);
  }
  return msg;
}

Plugin& plugin() {
  static Plugin* p = new Plugin;  // never destroyed (see plugin_state.h)
  return *p;
}

namespace {

[[noreturn]] void fail_open(const std::string& msg) { throw std::runtime_error(msg); }

uint64_t bytes_from_env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return 0;
  uint64_t n = 0;
  for (const char* c = v; *c; ++c) {
    if (*c < '0' || *c > '9' || n > (UINT64_MAX - 9) / 10) {
      fail_open(std::string("leasehold: ") + name + "=" + v +
                " is not a byte count (decimal digits)");
    }
    n = n * 10 + static_cast<uint64_t>(*c - '0');
  }
  return n;
}

}  // namespace

uint64_t budget_from_env() { return bytes_from_env("LEASEHOLD_BUDGET"); }

uint64_t guaranteed_from_env() { return bytes_from_env("LEASEHOLD_GUARANTEED"); }

BlockCache* open_cache(Plugin& p) {
  if (BlockCache* c = p.cache.load(std::memory_order_acquire)) return c;
  std::lock_guard lk(p.init_mu);
  if (BlockCache* c = p.cache.load(std::memory_order_relaxed)) return c;
  if (!p.init_error.empty()) throw std::runtime_error(p.init_error);
  lh_session* session = nullptr;
  try {
    lh_session_options opts;
    lh_session_options_init(&opts);
    lh_status st = lh_session_options_from_env(&opts);
    if (st == LH_ERR_NOT_FOUND) {
      fail_open(
          "leasehold: this process is not a Leasehold program job's (no job session in its "
          "environment), so the Leasehold allocator has no memory to give");
    }
    if (st != LH_OK) {
      fail_open(std::string("leasehold: the job's session settings: ") + lh_status_name(st) + ": " +
                last_error());
    }
    uint64_t budget = budget_from_env();
    st = lh_session_open(&opts, &session);
    if (st != LH_OK) {
      session = nullptr;
      fail_open(std::string("leasehold: cannot open the job's session with the coordinator: ") +
                lh_status_name(st) + ": " + last_error());
    }
    lh_pool_info info;
    st = lh_session_pool(session, &info);
    if (st != LH_OK) {
      fail_open(std::string("leasehold: the job's pool: ") + lh_status_name(st) + ": " +
                last_error());
    }
    if (!info.cuda) {
      fail_open(
          "leasehold: the job's pool is host memory (the coordinator runs the host backend): "
          "PyTorch's CUDA tensors cannot live in it");
    }
    if (budget == 0) {
      lh_session_stats ss;
      if (lh_session_stats_get(session, &ss) == LH_OK) budget = ss.budget_bytes;
    }
    BlockCacheOptions o;
    o.budget_bytes = budget;
    if (info.alignment) o.lease_alignment = info.alignment;
    // Never deleted, as the Plugin that points to them.
    auto* streams = new CudaStreams(info.device);
    // Address space for the segments, unbacked holes included: eight
    // times the most the job may hold (addresses are plentiful; memory is
    // not, and holes are backed again only when their segment goes).
    const uint64_t guaranteed = guaranteed_from_env();
    auto* leases = new SessionLeases(
        session, o.lease_alignment, 8 * (budget ? std::min(budget, info.size) : info.size),
        guaranteed, kLeasePiece, [&p](const std::string& why) { p.note_lost(why); });
    auto* cache = new BlockCache(*leases, *streams, o);
    p.session = session;
    p.streams = streams;
    p.device = info.device;
    p.budget = budget;
    p.guaranteed = guaranteed;
    start_shrink_worker(p);
    p.cache.store(cache, std::memory_order_release);
    lh_session_set_shrink_handler(session, on_shrink, &p);
    return cache;
  } catch (const std::exception& e) {
    if (session && !p.cache.load()) lh_session_close(session);
    p.init_error = one_line(e.what());
    throw std::runtime_error(p.init_error);
  }
}

uint64_t relieve_pressure(Plugin& p, uint64_t bytes) {
  // The handler frees tensors, whose frees and the allocations of its own
  // copies come back here: those must fail or succeed plainly.
  thread_local bool inside = false;
  if (inside) return 0;
  uint64_t (*fn)(uint64_t, void*);
  void* ctx;
  {
    std::lock_guard lk(p.pressure_mu);
    fn = p.pressure_fn;
    ctx = p.pressure_ctx;
  }
  if (fn == nullptr) return 0;
  struct Inside {  // reset however fn returns
    bool& flag;
    explicit Inside(bool& f) : flag(f) { flag = true; }
    ~Inside() { flag = false; }
  } guard(inside);
  return fn(bytes, ctx);
}

bool wait_may_touch(Plugin& p) {
  if (lh_session_may_touch(p.session)) return true;
  bool said = false;
  while (lh_session_connected(p.session)) {
    if (lh_session_may_touch(p.session)) {
      if (said) print_line("leasehold: the coordinator answers again; going on");
      return true;
    }
    if (!said) {
      print_line(
          "leasehold: the coordinator has not answered for a while; this allocation "
          "waits until it does");
      said = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  p.note_lost("its coordinator session was lost");
  return false;
}

}  // namespace leasehold::torch_plugin
