/* The Leasehold lease client (libleasehold.so): a session with the
 * coordinator, the pool mapped into this process, leases of it, and the
 * coordinator's Shrink requests. The agent, the engine's allocator and the
 * PyTorch plug-in (libleasehold_torch.so) all use it.
 *
 * It behaves inside somebody else's process: nothing here changes the
 * calling thread's current CUDA device (it is restored after mapping the
 * pool), nothing synchronizes the whole device, nothing sets environment
 * variables, and no exception crosses this interface. A process may hold
 * several sessions.
 *
 * Errors: every function returning lh_status leaves a message for humans in
 * lh_last_error() (per thread, valid until the next call on that thread).
 *
 * Thread safety: all functions may be called from any thread. A lease may
 * be released from another thread than the one that acquired it, but not
 * twice, and not while another thread still reads its fields. */
#ifndef LEASEHOLD_H
#define LEASEHOLD_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LEASEHOLD_C_API_VERSION 1

/* No exception leaves these functions; C++ callers see them noexcept. */
#ifdef __cplusplus
#define LH_NOEXCEPT noexcept
#else
#define LH_NOEXCEPT
#endif

typedef enum lh_status {
  LH_OK = 0,
  LH_ERR_INVALID_ARGUMENT = 1, /* a bad argument or option */
  LH_ERR_NO_SPACE = 2,         /* not now: the pool is full, or the job's budget */
  LH_ERR_TOO_LARGE = 3,        /* never: larger than the pool */
  LH_ERR_TIMEOUT = 4,          /* no answer, or not granted before the wait ended */
  LH_ERR_SESSION_LOST = 5,     /* the coordinator restarted or dropped this session */
  LH_ERR_PERMISSION = 6,       /* the coordinator refused this process */
  LH_ERR_NOT_FOUND = 7,        /* nothing to use (no program job in the environment) */
  LH_ERR_INTERNAL = 8          /* anything else (the pool cannot be mapped, ...) */
} lh_status;

/* A session with the coordinator: registration, heart-beats, the mapping of
 * the pool. */
typedef struct lh_session lh_session;
/* One lease: memory of the pool only this session may use. */
typedef struct lh_lease lh_lease;

typedef struct lh_session_options {
  /* The coordinator's endpoint; NULL: $LEASEHOLD_ENDPOINT, else the default
   * ipc:// socket. */
  const char* endpoint;
  /* Unique among the coordinator's agents; NULL: "HOST-PID" (with "-N"
   * added for the process's N-th session after the first). */
  const char* name;
  /* A program job's session (the agent gives these to the job's process in
   * its environment; lh_session_options_from_env reads them): its leases
   * count toward that job, within the job's memory budget. 0: none. */
  uint64_t job_id;
  uint32_t attempt;
  const char* job_token; /* 32 hex digits, the high 64 bits first; required with job_id */
  /* How long lh_session_open keeps trying to register; how long a request
   * that does not wait for memory may take (milliseconds; 0: defaults,
   * 10000 and 5000). */
  int64_t register_timeout_ms;
  int64_t request_timeout_ms;
  /* CURVE key files for a tcp:// endpoint (NULL: none). */
  const char* curve_key;
  const char* curve_server_key;
} lh_session_options;

/* What a session's pool is. */
typedef struct lh_pool_info {
  int cuda;           /* 1: device memory of CUDA device `device`; 0: host memory */
  int device;
  uint64_t size;
  uint64_t alignment; /* lease sizes are multiples of this */
  void* base;         /* the pool's first byte in this process */
} lh_pool_info;

/* The session's leases and what they hold, as the coordinator sees them. */
typedef struct lh_session_stats {
  uint64_t leases;
  uint64_t leased_bytes;
  uint64_t budget_bytes; /* the job's memory budget ($LEASEHOLD_BUDGET at open; 0: none known) */
} lh_session_stats;

/* Called from the session's heart-beat thread when the coordinator asks
 * for `bytes` back (the occupancy policy's Shrink); answer with
 * lh_session_shrink_done (from another thread, soon: within the
 * coordinator's shrink_timeout). It must not block, and must not call
 * lh_session_set_shrink_handler or lh_session_close. */
typedef void (*lh_shrink_fn)(void* user, uint64_t shrink_id, uint64_t bytes);

/* This thread's message about the latest failure ("" before any). Calls
 * that succeed leave it as it was. */
const char* lh_last_error(void) LH_NOEXCEPT;
/* "LH_OK", "LH_ERR_NO_SPACE", ... (static strings). */
const char* lh_status_name(lh_status status) LH_NOEXCEPT;

/* Defaults: everything zero or NULL. */
void lh_session_options_init(lh_session_options* options) LH_NOEXCEPT;
/* Reads the program job's session from the environment the agent sets:
 * LEASEHOLD_ENDPOINT, LEASEHOLD_AGENT, LEASEHOLD_JOB_ID,
 * LEASEHOLD_JOB_ATTEMPT, LEASEHOLD_JOB_TOKEN (and LEASEHOLD_CURVE_KEY,
 * LEASEHOLD_CURVE_SERVER_KEY); the rest as lh_session_options_init. The
 * name is "AGENT:jobID" (LEASEHOLD_AGENT, LEASEHOLD_JOB_ID), kept by the
 * library for the life of the process; the other strings point into the
 * environment. Changes nothing on failure.
 * LH_ERR_NOT_FOUND when this process is not a program job's (no
 * LEASEHOLD_JOB_ID); LH_ERR_INVALID_ARGUMENT when LEASEHOLD_JOB_ID is set
 * but it, LEASEHOLD_JOB_ATTEMPT or LEASEHOLD_JOB_TOKEN is missing or
 * malformed. */
lh_status lh_session_options_from_env(lh_session_options* options) LH_NOEXCEPT;

/* Connects, registers and maps the pool (`options` NULL: the defaults).
 * Keeps trying while the coordinator is unreachable, up to
 * register_timeout_ms (then LH_ERR_TIMEOUT). A program job's session the
 * coordinator does not accept (not its job, attempt or token):
 * LH_ERR_PERMISSION, saying why. `*session` is NULL on failure. */
lh_status lh_session_open(const lh_session_options* options, lh_session** session) LH_NOEXCEPT;
/* Unregisters (its leases go back) and unmaps once the last lease is gone;
 * leases still held are lost, and must still be released (which frees
 * them). The session's windows show nothing any more (they stay open, to
 * be closed). REQUIRES: no other thread uses the session or its windows.
 * NULL is ignored. */
void lh_session_close(lh_session* session) LH_NOEXCEPT;

lh_status lh_session_pool(lh_session* session, lh_pool_info* info) LH_NOEXCEPT;
lh_status lh_session_stats_get(lh_session* session, lh_session_stats* stats) LH_NOEXCEPT;
/* 1 while registered with a live coordinator. */
int lh_session_connected(lh_session* session) LH_NOEXCEPT;
/* 1 while leased memory may be touched: registered, and the coordinator
 * answered something sent recently enough that it has not fenced this
 * session's leases (the self-fence). */
int lh_session_may_touch(lh_session* session) LH_NOEXCEPT;

/* Leases at least `size` bytes (rounded up to the pool's alignment).
 * `wait_ms`: how long the coordinator may queue the request when memory is
 * short (-1: its default; 0: not at all). `needed`: the program cannot go on
 * without it (it has nothing left to give back). `*lease` is NULL on
 * failure: LH_ERR_TOO_LARGE (never fits), LH_ERR_NO_SPACE (not now, or
 * past the job's budget), LH_ERR_TIMEOUT, LH_ERR_SESSION_LOST (registering
 * again: try later). */
lh_status lh_lease_acquire(lh_session* session, uint64_t size, int64_t wait_ms, int needed,
                           lh_lease** lease) LH_NOEXCEPT;
/* The lease's memory (a device pointer for a CUDA pool); NULL once the
 * session that granted it is lost (and for NULL). */
void* lh_lease_data(const lh_lease* lease) LH_NOEXCEPT;
uint64_t lh_lease_size(const lh_lease* lease) LH_NOEXCEPT;
uint64_t lh_lease_id(const lh_lease* lease) LH_NOEXCEPT;
/* 1 once the session that granted it is lost (or closed): its memory must
 * not be used. 1 for NULL. */
int lh_lease_lost(const lh_lease* lease) LH_NOEXCEPT;
/* Gives the lease back and frees the handle (also when the answer is an
 * error: the handle is gone either way), except for a lease with pages
 * shown in a window: LH_ERR_INVALID_ARGUMENT, and nothing changes. A lost
 * lease has nothing to give back (the coordinator took it): LH_OK. The
 * caller must have finished every use of the memory, on the device too.
 * NULL is ignored. */
lh_status lh_lease_release(lh_lease* lease) LH_NOEXCEPT;

/* A window: address space of this process, reserved apart from the pool,
 * in which pages of the session's leases are shown again at whatever
 * offset the caller chooses (a page is the pool's alignment). Memory that
 * grows and shrinks by pages without fragmenting: a range of the window
 * may show pages of several leases, and a page freed in one place may back
 * another (PyTorch's expandable segments, with the pool's memory). The
 * window only shows pages; the leases hold them. A lease with pages shown
 * in a window cannot be released (hide them first), so no page of this
 * process's window ever shows memory the coordinator has handed on. */
typedef struct lh_window lh_window;

/* Reserves a window of at least `size` bytes (rounded up to pages) for
 * the leases of `session`'s current registration. LH_ERR_SESSION_LOST when
 * the session is not registered now; LH_ERR_INTERNAL naming the size when
 * the address space cannot be had. */
lh_status lh_window_open(lh_session* session, uint64_t size, lh_window** window) LH_NOEXCEPT;
/* The window's first byte (a device pointer for a CUDA pool), its size and
 * its page size; NULL and 0 for NULL. */
void* lh_window_base(const lh_window* window) LH_NOEXCEPT;
uint64_t lh_window_size(const lh_window* window) LH_NOEXCEPT;
uint64_t lh_window_page_size(const lh_window* window) LH_NOEXCEPT;
/* Shows `bytes` of `lease`, from `lease_offset` on, at `offset` of the
 * window, read-write: all or nothing. Offsets and size are multiples of
 * the page size. LH_ERR_INVALID_ARGUMENT for a range outside the window or
 * the lease, or a page of the range that shows something already;
 * LH_ERR_SESSION_LOST for a lost lease or one of another registration than
 * the window's. */
lh_status lh_window_show(lh_window* window, uint64_t offset, const lh_lease* lease,
                         uint64_t lease_offset, uint64_t bytes) LH_NOEXCEPT;
/* The pages of [offset, offset + bytes) (multiples of the page size) show
 * nothing any more; pages that showed nothing are skipped. The caller must
 * have finished every use of them, on the device too. LH_ERR_INTERNAL when
 * the backend failed to unmap a page: that page still shows its lease's
 * memory (and keeps the lease from being released). */
lh_status lh_window_hide(lh_window* window, uint64_t offset, uint64_t bytes) LH_NOEXCEPT;
/* Hides every page and frees the address space. NULL is ignored. */
void lh_window_close(lh_window* window) LH_NOEXCEPT;

/* ---- shared cache regions ----
 *
 * A region (coordinator/regions.md) is named memory of the pool that
 * outlives the jobs using it: a decoded dataset, published parameters. The
 * first attacher of a new region fills it and marks it ready; every later
 * attacher, on any agent of the device, gets the same memory, mapped
 * read-only, and the coordinator never evicts a region while anyone is
 * attached. */
typedef struct lh_region lh_region;

/* Attaches region `name` (1-128 letters, digits, '.', '_', '-', ':' and
 * '/', not starting with '/'). When it does not exist and `flags` has
 * LH_REGION_CREATE, it is created with `size` bytes and this attacher must fill it (lh_region_must_fill) and
 * then call lh_region_mark_ready; while another attacher fills it this
 * waits, up to `wait_ms` (-1: the coordinator's default). With
 * LH_REGION_REPLACE too, a region of that name nobody is attached to is
 * discarded and created anew (publishing new contents). `size` 0 without
 * CREATE: whatever size it has. LH_ERR_NOT_FOUND when it does not exist
 * (or was evicted, or its filler died) and CREATE is not given; LH_ERR_NO_SPACE
 * when there is no room for it; LH_ERR_INVALID_ARGUMENT for a bad name or
 * a size other than the region's; LH_ERR_TIMEOUT. */
#define LH_REGION_CREATE 1  /* create it when it does not exist */
#define LH_REGION_REPLACE 2 /* with CREATE: discard an unattached one and create it anew */
lh_status lh_region_attach(lh_session* session, const char* name, uint64_t size, int flags,
                           int64_t wait_ms, lh_region** region) LH_NOEXCEPT;
/* Its memory (a device pointer for a CUDA pool; read-only unless this
 * attacher fills it and has not marked it ready), its size, and whether
 * this attacher must fill it; NULL and 0 for NULL or a detached region. */
void* lh_region_data(const lh_region* region) LH_NOEXCEPT;
uint64_t lh_region_size(const lh_region* region) LH_NOEXCEPT;
int lh_region_must_fill(const lh_region* region) LH_NOEXCEPT;
/* The filler's writes are done (on the device too: synchronize first):
 * other attachers get the region now, and this attacher's mapping turns
 * read-only. */
lh_status lh_region_mark_ready(lh_region* region) LH_NOEXCEPT;
/* Gives the attachment back and frees the handle (whatever the answer; a
 * region left unfilled is discarded). NULL is ignored. Memory of it must
 * not be used afterwards. */
lh_status lh_region_detach(lh_region* region) LH_NOEXCEPT;

/* Installs (NULL: removes) the Shrink handler; waits for a call of the old
 * one in progress. */
void lh_session_set_shrink_handler(lh_session* session, lh_shrink_fn fn, void* user) LH_NOEXCEPT;
/* Answers Shrink `shrink_id`: `released` bytes given back (their leases
 * released already), `still_leased` held now, `reason` (may be NULL) why
 * less than asked. A Shrink not asked of this session: LH_ERR_INTERNAL,
 * saying so. */
lh_status lh_session_shrink_done(lh_session* session, uint64_t shrink_id, uint64_t released,
                                 uint64_t still_leased, const char* reason) LH_NOEXCEPT;

#ifdef __cplusplus
}
#endif

#endif /* LEASEHOLD_H */
