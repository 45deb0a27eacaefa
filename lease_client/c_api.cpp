// The C interface of libleasehold.so (lease_client/leasehold.h): sessions
// and leases, opaque handles around AgentSession and Lease (windows are in
// c_api_window.cpp; the handles and the error plumbing both use, in
// c_api_handles.h). No exception leaves this file: every entry point is
// noexcept, and whatever may throw runs inside `guarded`.
#include "lease_client/leasehold.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "lease_client/c_api_handles.h"
#include "lease_client/session.h"
#include "shared/curve_keys.h"
#include "shared/endpoint.h"

namespace leasehold::c_api {

// The latest failure's message, per thread. A plain buffer: nothing to
// destroy when a thread ends or the library is unloaded.
namespace {
constexpr size_t kErrorBytes = 4096;
thread_local char t_error[kErrorBytes];
}  // namespace

lh_status fail(lh_status status, std::string_view message) {
  const size_t n = std::min(message.size(), kErrorBytes - 1);
  message.copy(t_error, n);
  t_error[n] = '\0';
  return status;
}

const char* last_error() { return t_error; }

lh_status status_of(leasehold::ErrorCode code) {
  switch (code) {
    case leasehold::ErrorCode::UnknownSender:
      return LH_ERR_SESSION_LOST;
    case leasehold::ErrorCode::TooLarge:
      return LH_ERR_TOO_LARGE;
    case leasehold::ErrorCode::NoSpace:
      return LH_ERR_NO_SPACE;
    case leasehold::ErrorCode::Timeout:
      return LH_ERR_TIMEOUT;
    case leasehold::ErrorCode::PermissionDenied:
      return LH_ERR_PERMISSION;
    case leasehold::ErrorCode::InvalidArgument:
      return LH_ERR_INVALID_ARGUMENT;
    default:
      return LH_ERR_INTERNAL;
  }
}

}  // namespace leasehold::c_api

namespace {

using namespace leasehold::c_api;
using leasehold::AgentSession;
using leasehold::ErrorCode;
using leasehold::Lease;



// Strict decimal, no sign, no spaces; nullopt when not that or too large.
std::optional<uint64_t> parse_u64(const char* text, uint64_t max) {
  if (!text || *text < '0' || *text > '9') return std::nullopt;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || v > max) return std::nullopt;
  return v;
}

// 32 hex digits, the high 64 bits first (as the agent writes them).
std::optional<leasehold::SessionToken> parse_token(const char* text) {
  if (!text) return std::nullopt;
  const std::string_view t(text);
  if (t.size() != 32) return std::nullopt;
  uint64_t half[2] = {0, 0};
  for (size_t i = 0; i < 32; ++i) {
    const char c = t[i];
    int d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (c >= 'a' && c <= 'f') {
      d = c - 'a' + 10;
    } else if (c >= 'A' && c <= 'F') {
      d = c - 'A' + 10;
    } else {
      return std::nullopt;
    }
    half[i / 16] = half[i / 16] << 4 | static_cast<uint64_t>(d);
  }
  return leasehold::SessionToken{half[1], half[0]};
}

// "HOST-PID", then "HOST-PID-2", "HOST-PID-3", ...: a process may hold
// several sessions, and names are unique among the coordinator's agents.
std::string default_name() {
  static std::atomic<uint64_t> opened{0};
  char host[256] = {0};
  gethostname(host, sizeof host - 1);
  std::string name = std::string(host) + "-" + std::to_string(getpid());
  const uint64_t n = ++opened;
  if (n > 1) name += "-" + std::to_string(n);
  return name;
}

// Names made by lh_session_options_from_env ("AGENT:jobID"): kept for the
// life of the process, since the options only point at them.
const char* keep_name(std::string name) {
  static std::mutex mu;
  static auto* names = new std::set<std::string>();  // never freed: see above
  std::lock_guard lock(mu);
  return names->insert(std::move(name)).first->c_str();
}

}  // namespace

extern "C" {

const char* lh_last_error(void) noexcept { return leasehold::c_api::last_error(); }

const char* lh_status_name(lh_status status) noexcept {
  switch (status) {
    case LH_OK:
      return "LH_OK";
    case LH_ERR_INVALID_ARGUMENT:
      return "LH_ERR_INVALID_ARGUMENT";
    case LH_ERR_NO_SPACE:
      return "LH_ERR_NO_SPACE";
    case LH_ERR_TOO_LARGE:
      return "LH_ERR_TOO_LARGE";
    case LH_ERR_TIMEOUT:
      return "LH_ERR_TIMEOUT";
    case LH_ERR_SESSION_LOST:
      return "LH_ERR_SESSION_LOST";
    case LH_ERR_PERMISSION:
      return "LH_ERR_PERMISSION";
    case LH_ERR_NOT_FOUND:
      return "LH_ERR_NOT_FOUND";
    case LH_ERR_INTERNAL:
      return "LH_ERR_INTERNAL";
  }
  return "LH_ERR_UNKNOWN";
}

void lh_session_options_init(lh_session_options* options) noexcept {
  if (options) *options = lh_session_options{};
}

lh_status lh_session_options_from_env(lh_session_options* options) noexcept {
  if (!options) {
    return fail(LH_ERR_INVALID_ARGUMENT, "lh_session_options_from_env: options is NULL");
  }
  return guarded([&] {
    lh_session_options o;
    lh_session_options_init(&o);
    const char* job = std::getenv("LEASEHOLD_JOB_ID");
    if (!job || !*job) {
      return fail(LH_ERR_NOT_FOUND,
                  "LEASEHOLD_JOB_ID is not set: this process is not a Leasehold program job's");
    }
    auto id = parse_u64(job, UINT64_MAX);
    if (!id || *id == 0) {
      return fail(LH_ERR_INVALID_ARGUMENT,
                  "LEASEHOLD_JOB_ID is '" + std::string(job) + "', not a job id");
    }
    const char* attempt = std::getenv("LEASEHOLD_JOB_ATTEMPT");
    auto a = parse_u64(attempt, UINT32_MAX);
    if (!a) {
      return fail(LH_ERR_INVALID_ARGUMENT,
                  attempt ? "LEASEHOLD_JOB_ATTEMPT is '" + std::string(attempt) +
                                "', not an attempt number"
                          : std::string("LEASEHOLD_JOB_ID is set but LEASEHOLD_JOB_ATTEMPT is not"));
    }
    const char* token = std::getenv("LEASEHOLD_JOB_TOKEN");
    if (!token) {
      return fail(LH_ERR_INVALID_ARGUMENT,
                  "LEASEHOLD_JOB_ID is set but LEASEHOLD_JOB_TOKEN is not");
    }
    if (!parse_token(token)) {
      return fail(LH_ERR_INVALID_ARGUMENT, "LEASEHOLD_JOB_TOKEN is not 32 hex digits");
    }
    o.job_id = *id;
    o.attempt = static_cast<uint32_t>(*a);
    o.job_token = token;
    const char* endpoint = std::getenv(leasehold::kEndpointEnv);
    o.endpoint = endpoint && *endpoint ? endpoint : nullptr;
    if (const char* agent = std::getenv("LEASEHOLD_AGENT"); agent && *agent) {
      o.name = keep_name(std::string(agent) + ":job" + std::to_string(*id));
    }
    const char* key = std::getenv(leasehold::kCurveKeyEnv);
    const char* server_key = std::getenv(leasehold::kCurveServerKeyEnv);
    o.curve_key = key && *key ? key : nullptr;
    o.curve_server_key = server_key && *server_key ? server_key : nullptr;
    *options = o;
    return LH_OK;
  });
}

lh_status lh_session_open(const lh_session_options* options, lh_session** session) noexcept {
  if (!session) return fail(LH_ERR_INVALID_ARGUMENT, "lh_session_open: session is NULL");
  *session = nullptr;
  return guarded([&] {
    lh_session_options given;
    lh_session_options_init(&given);
    if (options) given = *options;
    if (given.register_timeout_ms < 0 || given.request_timeout_ms < 0) {
      return fail(LH_ERR_INVALID_ARGUMENT, "lh_session_open: a timeout is negative");
    }
    leasehold::AgentOptions o;
    o.endpoint = given.endpoint && *given.endpoint ? given.endpoint : leasehold::default_endpoint();
    o.name = given.name && *given.name ? given.name : default_name();
    if (given.job_id != 0) {
      auto token = parse_token(given.job_token);
      if (!token) {
        return fail(LH_ERR_INVALID_ARGUMENT,
                    "lh_session_open: job " + std::to_string(given.job_id) +
                        " needs its job_token (32 hex digits)");
      }
      o.job_id = given.job_id;
      o.attempt = given.attempt;
      o.job_token = *token;
    } else if (given.job_token || given.attempt) {
      return fail(LH_ERR_INVALID_ARGUMENT,
                  "lh_session_open: job_token or attempt given without a job_id");
    }
    if (given.register_timeout_ms > 0) {
      o.register_timeout = std::chrono::milliseconds(given.register_timeout_ms);
    }
    if (given.request_timeout_ms > 0) {
      o.request_timeout = std::chrono::milliseconds(given.request_timeout_ms);
    }
    try {
      o.curve = leasehold::client_curve_keys(o.endpoint,
                                             given.curve_key ? given.curve_key : "",
                                             given.curve_server_key ? given.curve_server_key : "");
    } catch (const std::runtime_error& e) {
      return fail(LH_ERR_INVALID_ARGUMENT, e.what());
    }
    // A library inside somebody else's process: no jobs, and the
    // environment (MPS) is left as it is.
    o.takes_jobs = false;
    o.join_mps = false;
    auto s = std::make_unique<lh_session>();
    if (const char* budget = std::getenv("LEASEHOLD_BUDGET")) {
      s->budget_bytes = parse_u64(budget, UINT64_MAX).value_or(0);
    }
    s->session = std::make_unique<AgentSession>(std::move(o));
    *session = s.release();
    return LH_OK;
  });
}

void lh_session_close(lh_session* session) noexcept {
  if (!session) return;
  // Its leases go back as it unregisters: no window may show their pages
  // any more (a CUDA window holds the memory itself).
  {
    std::lock_guard lock(session->leases->mu);
    for (lh_window* w : session->leases->windows) {
      if (lh_window_hide(w, 0, lh_window_size(w)) != LH_OK) {
        std::fprintf(stderr, "leasehold: closing a session: %s\n", lh_last_error());
      }
    }
  }
  // Unregistering is best effort (logged); the destructor never throws.
  delete session;
}

lh_status lh_session_pool(lh_session* session, lh_pool_info* info) noexcept {
  if (!session || !info) return fail(LH_ERR_INVALID_ARGUMENT, "lh_session_pool: a NULL argument");
  return guarded([&] {
    const leasehold::PoolDescriptor pool = session->session->pool();
    lh_pool_info out{};
    out.cuda = pool.backend == leasehold::Backend::Cuda ? 1 : 0;
    out.device = pool.device;
    out.size = pool.size;
    out.alignment = pool.alignment;
    out.base = session->session->pool_base();
    *info = out;
    return LH_OK;
  });
}

lh_status lh_session_stats_get(lh_session* session, lh_session_stats* stats) noexcept {
  if (!session || !stats) {
    return fail(LH_ERR_INVALID_ARGUMENT, "lh_session_stats_get: a NULL argument");
  }
  return guarded([&] {
    lh_session_stats out{};
    out.budget_bytes = session->budget_bytes;
    std::lock_guard lock(session->leases->mu);
    for (const lh_lease* l : session->leases->leases) {
      // A lost lease is the coordinator's again.
      if (l->lease.held() && !l->lease.lost()) {
        ++out.leases;
        out.leased_bytes += l->lease.size();
      }
    }
    *stats = out;
    return LH_OK;
  });
}

int lh_session_connected(lh_session* session) noexcept {
  return guarded_or(0, [&] { return session && session->session->connected() ? 1 : 0; });
}

int lh_session_may_touch(lh_session* session) noexcept {
  return guarded_or(0, [&] { return session && session->session->may_touch() ? 1 : 0; });
}

lh_status lh_lease_acquire(lh_session* session, uint64_t size, int64_t wait_ms, int needed,
                           lh_lease** lease) noexcept {
  if (!lease) return fail(LH_ERR_INVALID_ARGUMENT, "lh_lease_acquire: lease is NULL");
  *lease = nullptr;
  if (!session) return fail(LH_ERR_INVALID_ARGUMENT, "lh_lease_acquire: session is NULL");
  if (size == 0) return fail(LH_ERR_INVALID_ARGUMENT, "lh_lease_acquire: size is 0");
  return guarded([&] {
    if (wait_ms < -1) {
      return fail(LH_ERR_INVALID_ARGUMENT,
                  "lh_lease_acquire: wait_ms is " + std::to_string(wait_ms) + " (-1: the default)");
    }
    std::optional<std::chrono::milliseconds> wait;
    if (wait_ms >= 0) wait = std::chrono::milliseconds(wait_ms);
    auto l = std::make_unique<lh_lease>();
    l->lease = session->session->acquire(size, leasehold::LeaseEnd::Low, wait, needed != 0);
    l->set = session->leases;
    {
      std::lock_guard lock(l->set->mu);
      l->set->leases.insert(l.get());
    }
    *lease = l.release();
    return LH_OK;
  });
}

void* lh_lease_data(const lh_lease* lease) noexcept {
  // data() throws when the lease was lost meanwhile: NULL then too.
  return guarded_or<void*>(nullptr, [&]() -> void* {
    if (!lease || lease->lease.lost()) return nullptr;
    return lease->lease.data();
  });
}

uint64_t lh_lease_size(const lh_lease* lease) noexcept { return lease ? lease->lease.size() : 0; }

uint64_t lh_lease_id(const lh_lease* lease) noexcept { return lease ? lease->lease.id() : 0; }

// When even that cannot be told: lost (1), so that the memory is not used.
int lh_lease_lost(const lh_lease* lease) noexcept {
  return guarded_or(1, [&] { return !lease || lease->lease.lost() ? 1 : 0; });
}

lh_status lh_lease_release(lh_lease* lease) noexcept {
  if (!lease) return LH_OK;
  if (const uint64_t shown = lease->shown.load()) {
    return fail(LH_ERR_INVALID_ARGUMENT,
                "lh_lease_release: lease " + std::to_string(lease->lease.id()) + " has " +
                    std::to_string(shown) + " pages shown in a window; hide them first");
  }
  return guarded([&] {
    {
      std::lock_guard lock(lease->set->mu);
      lease->set->leases.erase(lease);
    }
    // Out of the set, so freed whatever the answer. Lease::release gives
    // the handle up whatever the answer, so the destructor never tries again.
    std::unique_ptr<lh_lease> owned(lease);
    if (owned->lease.held()) owned->lease.release();
    return LH_OK;
  });
}

void lh_session_set_shrink_handler(lh_session* session, lh_shrink_fn fn, void* user) noexcept {
  if (!session) return;
  // Copying a std::function may allocate: a failure leaves only the message.
  guarded([&] {
    if (!fn) {
      session->session->set_shrink_handler({});
    } else {
      session->session->set_shrink_handler([fn, user](const leasehold::proto::ShrinkT& s) {
        fn(user, s.id, s.bytes);
      });
    }
    return LH_OK;
  });
}

lh_status lh_session_shrink_done(lh_session* session, uint64_t shrink_id, uint64_t released,
                                 uint64_t still_leased, const char* reason) noexcept {
  if (!session) return fail(LH_ERR_INVALID_ARGUMENT, "lh_session_shrink_done: session is NULL");
  return guarded([&] {
    session->session->send_shrink_done(shrink_id, released, still_leased, reason ? reason : "");
    return LH_OK;
  });
}

}  // extern "C"
