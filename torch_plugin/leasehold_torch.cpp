// libleasehold_torch.so's exported C functions (leasehold_torch.h): what
// PyTorch's CUDAPluggableAllocator and python/leasehold/torch.py call. Each
// turns the C call into one on the block cache (block_cache.h), opened on the
// job's session at the first allocation (plugin_state.h), and turns failures
// into what PyTorch expects: exceptions of c10's types from the allocation,
// one line on standard error and nothing thrown from the rest.
// docs/torch-plugin.md says how the plug-in fits together.
#include "torch_plugin/leasehold_torch.h"

#include <c10/util/Exception.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <string>

#include "torch_plugin/block_cache.h"
#include "torch_plugin/cuda_streams.h"
#include "torch_plugin/plugin_state.h"
#include "torch_plugin/session_leases.h"
#include "torch_plugin/standby_arena.h"

using namespace leasehold::torch_plugin;

namespace {

// How many times one allocation asks the pressure handler before it fails.
constexpr int kPressureRounds = 4;

// The cache's allocation, with the pressure handler's help when it finds no
// room: the handler frees tensors (spills them) and the allocation is tried
// again, as long as the handler freed something. Not during a capture: the
// handler's copies would be captured too. Growth past the job's guaranteed
// share is opportunistic until then (growth_rule.h); once there is
// nothing more to spill, the last try asks for it as needed.
void* allocate_relieved(Plugin& p, BlockCache& cache, uint64_t size, StreamId stream) {
  const bool may_grow = p.guaranteed != 0 && (p.budget == 0 || p.guaranteed < p.budget);
  for (int round = 0;; ++round) {
    try {
      return cache.allocate(size, stream);
    } catch (const OutOfMemory&) {
      if (round < kPressureRounds && !p.streams->capturing(stream) &&
          relieve_pressure(p, size) != 0) {
        continue;
      }
      if (!may_grow || p.streams->capturing(stream)) throw;
    }
    break;
  }
  NeededGrowth needed;
  return cache.allocate(size, stream);
}

}  // namespace

extern "C" {

void* leasehold_torch_alloc(ssize_t size, int device, struct CUstream_st* stream) {
  if (size == 0) return nullptr;  // as PyTorch's own allocator: a NULL DataPtr is never freed
  std::string error;
  bool oom = false, printed = false;
  if (size < 0) {
    error = "leasehold: allocation of a negative size (" + std::to_string(size) + " bytes)";
  } else {
    Plugin& p = plugin();
    try {
      if (standby_arena_active()) return standby_arena_allocate(static_cast<uint64_t>(size), device);
      BlockCache* cache = open_cache(p);
      if (device != p.device) {
        const char* want = std::getenv("LEASEHOLD_DEVICE");
        error = "leasehold: PyTorch asked for memory on CUDA device " + std::to_string(device) +
                ", but this job's memory is on device " + std::to_string(p.device) +
                " (a program job has one device: " + (want ? want : "its LEASEHOLD_DEVICE") + ")";
      } else if (p.lost.load(std::memory_order_acquire)) {
        error = p.lost_message();
        printed = true;
      } else if (!wait_may_touch(p)) {
        error = p.lost_message();
        printed = true;
      } else {
        return allocate_relieved(p, *cache, static_cast<uint64_t>(size),
                                 reinterpret_cast<StreamId>(stream));
      }
    } catch (const OutOfMemory& e) {
      error = e.what();
      oom = true;
      p.refused.fetch_add(1, std::memory_order_relaxed);
    } catch (const LeaseFailure& e) {
      if (p.lost.load(std::memory_order_acquire)) {
        error = p.lost_message();
        printed = true;
      } else {
        error = e.what();
      }
    } catch (const std::exception& e) {
      error = e.what();
    } catch (...) {
      error = "leasehold: allocation failed (unknown exception)";
    }
  }
  error = one_line(error);
  if (!printed) print_line(error);
  // PyTorch's pluggable allocator does not check for NULL: throw what its
  // own allocator throws (torch.OutOfMemoryError / RuntimeError in Python).
  if (oom) TORCH_CHECK_WITH(OutOfMemoryError, false, error);
  TORCH_CHECK(false, error);
  return nullptr;  // not reached
}

void leasehold_torch_free(void* ptr, ssize_t /*size*/, int /*device*/,
                          struct CUstream_st* /*stream*/) {
  // The block's own size and stream are the cache's: PyTorch has been seen
  // to pass another size than it allocated (pytorch issue 153109).
  if (ptr == nullptr) return;
  if (standby_arena_free(ptr)) return;
  BlockCache* cache = plugin().cache.load(std::memory_order_acquire);
  if (cache == nullptr) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "leasehold: free of %p before any allocation", ptr);
    print_line(buf);
    return;
  }
  try {
    cache->free(ptr);
  } catch (const std::exception& e) {
    if (!runtime_gone(e)) print_line(e.what());
  } catch (...) {
    print_line("leasehold: free failed (unknown exception)");
  }
}

void leasehold_torch_record_stream(void* ptr, struct CUstream_st* stream) {
  if (ptr == nullptr) return;
  BlockCache* cache = plugin().cache.load(std::memory_order_acquire);
  if (cache == nullptr) return;
  try {
    cache->record_stream(ptr, reinterpret_cast<StreamId>(stream));
  } catch (const std::exception& e) {
    print_line(e.what());
  } catch (...) {
    print_line("leasehold: record_stream failed (unknown exception)");
  }
}

void leasehold_torch_empty_cache(void) {
  BlockCache* cache = plugin().cache.load(std::memory_order_acquire);
  if (cache == nullptr) return;
  try {
    cache->empty_cache();
  } catch (const std::exception& e) {
    if (!runtime_gone(e)) print_line(e.what());
  } catch (...) {
    print_line("leasehold: empty_cache failed (unknown exception)");
  }
}

int leasehold_torch_stats(struct leasehold_torch_stats* out) {
  if (out == nullptr) return -1;
  std::memset(out, 0, sizeof *out);
  Plugin& p = plugin();
  BlockCache* cache = p.cache.load(std::memory_order_acquire);
  if (cache == nullptr) {
    try {
      out->budget_bytes = budget_from_env();
    } catch (const std::exception&) {
    }
    return 0;
  }
  BlockCacheStats st = cache->stats();
  out->leased_bytes = st.leased_bytes;
  out->peak_leased_bytes = st.peak_leased_bytes;
  out->in_use_bytes = st.in_use_bytes;
  out->peak_in_use_bytes = st.peak_in_use_bytes;
  out->allocations = st.allocations;
  out->cache_hits = st.cache_hits;
  out->lease_requests = st.lease_requests;
  out->budget_bytes = p.budget;
  out->unbacked_bytes = st.unbacked_bytes;
  out->unbacks = st.unbacks;
  out->refused_allocations = p.refused.load(std::memory_order_relaxed);
  return 0;
}

struct lh_session* leasehold_torch_session(void) {
  if (standby_arena_active()) {
    print_line("leasehold: a standby has no job, and so no session, before its job starts");
    return nullptr;
  }
  Plugin& p = plugin();
  try {
    open_cache(p);
    return p.session;
  } catch (const std::exception& e) {
    print_line(e.what());
  } catch (...) {
    print_line("leasehold: the job's session cannot be opened (unknown exception)");
  }
  return nullptr;
}

int leasehold_torch_standby_begin(void) { return standby_arena_open() ? 0 : -1; }

uint64_t leasehold_torch_standby_end(void) { return standby_arena_close(); }

void leasehold_torch_set_pressure_handler(leasehold_torch_pressure_fn fn, void* ctx) {
  Plugin& p = plugin();
  std::lock_guard lk(p.pressure_mu);
  p.pressure_fn = fn;
  p.pressure_ctx = fn ? ctx : nullptr;
}

int leasehold_torch_abi_version(void) { return LEASEHOLD_TORCH_ABI_VERSION; }

}  // extern "C"
