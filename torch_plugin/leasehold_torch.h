/* libleasehold_torch.so: Leasehold's memory as PyTorch's CUDA allocator
 * (docs/torch-plugin.md). A program job's Python loads it through
 *
 *   alloc = torch.cuda.memory.CUDAPluggableAllocator(
 *       path, "leasehold_torch_alloc", "leasehold_torch_free")
 *   alloc.allocator().set_record_stream_fn(<leasehold_torch_record_stream>)
 *   alloc.allocator().set_reset_fn(<leasehold_torch_empty_cache>)
 *   torch.cuda.memory.change_current_allocator(alloc)
 *
 * before its first CUDA allocation; python/leasehold/torch.py does this (the
 * agent's sitecustomize calls it right after `import torch`).
 *
 * Memory comes from leases of the job's own session with the coordinator
 * (lease_client/leasehold.h), opened at the first allocation from the
 * environment the agent sets; at most LEASEHOLD_BUDGET bytes (decimal) are
 * leased at once. Blocks are cached and reused in stream order
 * (torch_plugin/block_cache.h).
 *
 * Nothing here changes the calling thread's current CUDA device for longer
 * than a call, nothing synchronizes a whole device, and every function may
 * be called from any thread. */
#ifndef LEASEHOLD_TORCH_H
#define LEASEHOLD_TORCH_H

#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this interface (the functions and the stats struct); the
 * Python side refuses a plug-in of another. */
#define LEASEHOLD_TORCH_ABI_VERSION 5

/* cudaStream_t, without the CUDA headers. */
struct CUstream_st;
/* The lease client's session (lease_client/leasehold.h). */
struct lh_session;

/* The plug-in is built with hidden visibility: these are its only exports. */
#if defined(__GNUC__)
#define LEASEHOLD_TORCH_API __attribute__((visibility("default")))
#else
#define LEASEHOLD_TORCH_API
#endif

/* What the allocator did, as python's leasehold.report sends it to the
 * agent ("memory" lines). Fields are only ever appended. A struct tag and
 * no typedef, as POSIX's struct stat and stat(): the function of the same
 * name fills it. */
struct leasehold_torch_stats {
  uint64_t leased_bytes; /* leased from the pool now (pages that show memory) */
  uint64_t peak_leased_bytes;
  uint64_t in_use_bytes; /* handed to PyTorch now (rounded block sizes) */
  uint64_t peak_in_use_bytes;
  uint64_t allocations;    /* PyTorch's requests served (size 0 not counted) */
  uint64_t cache_hits;     /* ... of them without a new lease */
  uint64_t lease_requests; /* segments asked of the lease source (from its stock or new leases) */
  uint64_t budget_bytes;   /* the job's budget (0: none known) */
  uint64_t unbacked_bytes; /* free pages inside segments given back now (version 2) */
  uint64_t unbacks;        /* times free pages were given back so (version 2) */
  uint64_t refused_allocations; /* PyTorch's requests answered out of memory, after
                                   the pressure handler's help (version 5): PyTorch
                                   may then choose a kernel with a smaller workspace */
};

/* PyTorch's allocation: `size` bytes for `device` (which must be the job's,
 * the device of its pool), ordered on `stream`. Size 0 returns NULL, as
 * PyTorch's own allocator and cudaMalloc do (the pluggable allocator never
 * frees a NULL DataPtr). Out of memory throws c10::OutOfMemoryError
 * (torch.OutOfMemoryError in Python) after one "leasehold: ..." line on
 * standard error naming the request, the bytes in use, the bytes cached and
 * the budget; other failures (no program job, a lost session) throw
 * c10::Error with a message starting "leasehold:". PyTorch's pluggable
 * allocator does not check for NULL, hence the exceptions. */
LEASEHOLD_TORCH_API void* leasehold_torch_alloc(ssize_t size, int device,
                                                struct CUstream_st* stream);
/* Frees `ptr` (NULL is ignored). `stream` is the one it was allocated on;
 * the block becomes reusable in that stream's order (see block_cache.h).
 * Never throws: a failure is printed on standard error. */
LEASEHOLD_TORCH_API void leasehold_torch_free(void* ptr, ssize_t size, int device,
                                              struct CUstream_st* stream);
/* torch.Tensor.record_stream: `ptr` is used on `stream` too. Never throws. */
LEASEHOLD_TORCH_API void leasehold_torch_record_stream(void* ptr, struct CUstream_st* stream);
/* torch.cuda.empty_cache: gives every fully free cached lease back (after
 * waiting for the events its blocks need). Never throws. */
LEASEHOLD_TORCH_API void leasehold_torch_empty_cache(void);
/* Fills *out (zeros before the first allocation). 0; -1 when out is NULL. */
LEASEHOLD_TORCH_API int leasehold_torch_stats(struct leasehold_torch_stats* out);
/* A Python standby's warm-up (version 3; agent/python_standby.h): between
 * begin and end, allocations are the standby's own cudaMalloc's, made
 * before it has a job (and so a session); they are freed with cudaFree
 * whenever PyTorch frees them. begin: 0, or -1 once the job's session is
 * open or when called twice. end: the bytes still allocated that way (the
 * standby must see 0 before it takes a job); later allocations come from
 * the job's leases. */
LEASEHOLD_TORCH_API int leasehold_torch_standby_begin(void);
LEASEHOLD_TORCH_API uint64_t leasehold_torch_standby_end(void);
/* The job's session (version 3), opened now if no allocation has opened it
 * yet: for the lease client's calls that need one (lh_region_* for shared
 * regions; python/leasehold/regions.py). NULL, after one "leasehold: ..."
 * line on standard error, when it cannot be opened. Closed only when the
 * process ends. */
LEASEHOLD_TORCH_API struct lh_session* leasehold_torch_session(void);
/* Memory pressure (version 4). `fn(bytes, ctx)` is asked to free about
 * `bytes` of device memory (python/leasehold/spill.py spills saved
 * activations) and returns the bytes it freed, 0 when it could free
 * nothing. The plug-in calls it
 * - when an allocation finds no room within the budget after the cache gave
 *   back what it could; the allocation is then retried (the freed blocks
 *   are reused once the work that frees them, a copy, has completed);
 * - when the coordinator's Shrink asks for more than the cache holds free;
 *   the cache is then trimmed again before the answer.
 * It is called on the allocating thread (or the shrink worker's), never
 * during a CUDA graph capture, never within itself on one thread, and
 * without any lock of the plug-in held: it may free and allocate tensors.
 * fn NULL removes the handler. */
typedef uint64_t (*leasehold_torch_pressure_fn)(uint64_t bytes, void* ctx);
LEASEHOLD_TORCH_API void leasehold_torch_set_pressure_handler(leasehold_torch_pressure_fn fn,
                                                              void* ctx);
/* LEASEHOLD_TORCH_ABI_VERSION of the loaded plug-in. */
LEASEHOLD_TORCH_API int leasehold_torch_abi_version(void);

#ifdef __cplusplus
}
#endif

#endif /* LEASEHOLD_TORCH_H */
