#include "shared/device.h"

#include <spdlog/spdlog.h>

#include <fcntl.h>
#include <sys/resource.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <stdexcept>

#include "shared/detail/backends.h"
#include "shared/units.h"

namespace leasehold {

const char* backend_name(Backend b) { return b == Backend::Cuda ? "cuda" : "host"; }

std::optional<Backend> parse_backend(std::string_view text) {
  if (text == "host") return Backend::Host;
  if (text == "cuda") return Backend::Cuda;
  return std::nullopt;
}

bool cuda_built() {
#ifdef LEASEHOLD_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_ordinal_of(std::string_view uuid) {
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::cuda_ordinal_of(uuid);
#else
  (void)uuid;
  return -1;
#endif
}

int cuda_device_count() {
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::cuda_visible_devices();
#else
  return 0;
#endif
}

Backend resolve_backend(std::string_view text) {
  if (text == "auto") return cuda_device_count() > 0 ? Backend::Cuda : Backend::Host;
  auto b = parse_backend(text);
  if (!b) {
    throw std::runtime_error("unknown backend '" + std::string(text) +
                             "' (expected auto, cuda or host)");
  }
  if (*b == Backend::Cuda) {
    if (!cuda_built()) {
      throw std::runtime_error("backend 'cuda' requested but this build has no CUDA support");
    }
    if (cuda_device_count() == 0) {
      throw std::runtime_error("backend 'cuda' requested but no CUDA device is visible");
    }
  }
  return *b;
}

DeviceMemory query_device_memory(Backend backend, int device) {
  if (backend == Backend::Host) return detail::query_host_memory();
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::query_cuda_memory(device);
#else
  (void)device;
  throw std::runtime_error("this build has no CUDA support");
#endif
}

uint64_t chunk_granularity(Backend backend, int device) {
  if (backend == Backend::Host) return detail::host_granularity();
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::cuda_granularity(device);
#else
  (void)device;
  throw std::runtime_error("this build has no CUDA support");
#endif
}

std::unique_ptr<DevicePool> create_pool(Backend backend, int device, uint64_t size,
                                        uint64_t alignment) {
  const uint64_t granularity = chunk_granularity(backend, device);
  if (alignment == 0 || alignment % granularity != 0) {
    throw std::invalid_argument("alignment " + format_bytes(alignment) +
                                " is not a whole number of the " + backend_name(backend) +
                                " backend's mapping granularity (" + format_bytes(granularity) +
                                " on device " + std::to_string(device) +
                                "): every lease is mapped as whole chunks of the alignment");
  }
  size -= size % alignment;
  if (size == 0) {
    throw std::invalid_argument("a pool smaller than one chunk of " + format_bytes(alignment));
  }
  if (backend == Backend::Host) return detail::create_host_pool(device, size, alignment);
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::create_cuda_pool(device, size, alignment);
#else
  throw std::runtime_error("cannot create a CUDA pool: this build has no CUDA support");
#endif
}

std::unique_ptr<PoolMapping> map_pool(const PoolDescriptor& desc) {
  if (desc.alignment == 0 || desc.size % desc.alignment != 0) {
    throw std::runtime_error("the pool of device " + std::to_string(desc.device) + " (" +
                             std::to_string(desc.size) + " bytes) is not whole chunks of " +
                             std::to_string(desc.alignment) + " bytes, as the coordinator said");
  }
  if (desc.backend == Backend::Host) return detail::map_host_pool(desc);
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::map_cuda_pool(desc);
#else
  throw std::runtime_error("cannot map a CUDA pool: this build has no CUDA support");
#endif
}

UniqueFd DevicePool::share(uint64_t i, Access access) const {
  std::lock_guard lock(fds_mu_);
  if (!chunk_fds_.at(i).valid()) {
    throw std::runtime_error("chunk " + std::to_string(i) + " has no memory (its renewal failed)");
  }
  return share_chunk(i, access);
}

void DevicePool::renew(uint64_t first, uint64_t count) {
  for (uint64_t i = first; i < first + count; ++i) {
    std::lock_guard lock(fds_mu_);
    if (i >= chunk_fds_.size()) throw std::out_of_range("chunk " + std::to_string(i));
    renew_chunk(i);
  }
}

UniqueFd DevicePool::share_chunk(uint64_t i, Access) const {
  UniqueFd fd(::fcntl(chunk_fd(i), F_DUPFD_CLOEXEC, 0));
  if (!fd.valid()) {
    throw std::runtime_error("cannot share chunk " + std::to_string(i) + ": " + std::strerror(errno));
  }
  return fd;
}

const char* access_name(Access a) { return a == Access::ReadWrite ? "read-write" : "read-only"; }

// ---- PoolMapping: the counting; the backends map ----

namespace {
uint32_t& counter(uint32_t& read_only, uint32_t& read_write, Access access) {
  return access == Access::ReadWrite ? read_write : read_only;
}
}  // namespace

void PoolMapping::map(uint64_t first, std::vector<UniqueFd> fds, Access access) {
  const uint64_t count = fds.size();
  const uint64_t chunks = desc_.chunk_count();
  if (first > chunks || count > chunks - first) {
    throw std::out_of_range("chunks " + std::to_string(first) + "+" + std::to_string(count) +
                            " are outside the pool's " + std::to_string(chunks));
  }
  std::lock_guard lock(mu_);
  if (maps_.empty()) maps_.resize(chunks);
  std::vector<uint64_t> counted;  // what this call counted: undone if it fails
  std::vector<int> run;           // chunks not mapped yet, from run_first on
  uint64_t run_first = 0;
  // Runs of new chunks go to the backend whole (one access change, not one
  // per chunk).
  auto flush = [&] {
    if (run.empty()) return;
    map_chunks(run_first, run, access);
    for (uint64_t k = 0; k < run.size(); ++k) {
      Maps& m = maps_[run_first + k];
      ++counter(m.read_only, m.read_write, access);
      counted.push_back(run_first + k);
    }
    run.clear();
  };
  try {
    for (uint64_t k = 0; k < count; ++k) {
      const uint64_t i = first + k;
      Maps& m = maps_[i];
      if (m.read_only == 0 && m.read_write == 0) {
        if (run.empty()) run_first = i;
        run.push_back(fds[k].get());
        continue;
      }
      flush();
      if (access == Access::ReadWrite && m.read_write == 0) widen_chunk(i, fds[k].get());
      ++counter(m.read_only, m.read_write, access);
      counted.push_back(i);
    }
    flush();
  } catch (...) {
    for (uint64_t i : counted) unmap_locked(i, 1, access);
    throw;
  }
  // `fds` closes as it goes: a mapping keeps its memory.
}

void PoolMapping::unmap(uint64_t first, uint64_t count, Access access) noexcept {
  std::lock_guard lock(mu_);
  unmap_locked(first, count, access);
}

void PoolMapping::unmap_locked(uint64_t first, uint64_t count, Access access) noexcept {
  uint64_t run_first = 0, run = 0;  // chunks whose last map this was
  auto flush = [&] {
    if (run) unmap_chunks(run_first, run);
    run = 0;
  };
  for (uint64_t i = first; i < first + count && i < maps_.size(); ++i) {
    Maps& m = maps_[i];
    uint32_t& n = counter(m.read_only, m.read_write, access);
    if (n == 0) {  // not mapped with this access: nothing to undo
      flush();
      continue;
    }
    --n;
    if (m.read_write == 0 && m.read_only == 0) {
      if (run == 0) run_first = i;
      ++run;
      continue;
    }
    flush();
    if (access == Access::ReadWrite && m.read_write == 0) {
      try {
        protect_chunk(i, Access::ReadOnly);
      } catch (const std::exception& e) {
        spdlog::error("cannot make chunk {} read-only again: {}", i, e.what());
      }
    }
  }
  flush();
}

void PoolMapping::narrow(uint64_t first, uint64_t count) noexcept {
  std::lock_guard lock(mu_);
  for (uint64_t i = first; i < first + count && i < maps_.size(); ++i) {
    Maps& m = maps_[i];
    if (m.read_write == 0) continue;
    --m.read_write;
    ++m.read_only;
    if (m.read_write > 0) continue;
    try {
      protect_chunk(i, Access::ReadOnly);
    } catch (const std::exception& e) {
      spdlog::error("cannot make chunk {} read-only: {}", i, e.what());
    }
  }
}

void PoolMapping::unmap_all() noexcept {
  std::lock_guard lock(mu_);
  for (uint64_t i = 0; i < maps_.size(); ++i) {
    if (maps_[i].read_only || maps_[i].read_write) unmap_chunks(i, 1);
    maps_[i] = Maps{};
  }
}

std::optional<Access> PoolMapping::access(uint64_t i) const {
  std::lock_guard lock(mu_);
  if (i >= maps_.size()) return std::nullopt;
  if (maps_[i].read_write) return Access::ReadWrite;
  if (maps_[i].read_only) return Access::ReadOnly;
  return std::nullopt;
}

namespace detail {

void reserve_descriptors(uint64_t needed, const std::string& what) {
  // Room for what the process opens besides: the chunk socket's
  // connections, ZeroMQ's sockets, the store, files.
  constexpr uint64_t kHeadroom = 2048;
  struct rlimit lim {};
  if (::getrlimit(RLIMIT_NOFILE, &lim) != 0 || lim.rlim_cur == RLIM_INFINITY) return;
  const uint64_t want = needed + kHeadroom;
  if (lim.rlim_cur >= want) return;
  const uint64_t hard = lim.rlim_max;
  lim.rlim_cur = want;
  // Past the hard limit only with CAP_SYS_RESOURCE (root, usually).
  if (lim.rlim_max != RLIM_INFINITY && lim.rlim_max < want) lim.rlim_max = want;
  if (::setrlimit(RLIMIT_NOFILE, &lim) != 0) {
    throw std::runtime_error(what + " needs " + std::to_string(needed) +
                             " file descriptors (one per chunk) and this process may open at "
                             "most " +
                             std::to_string(hard) +
                             ": raise the limit (ulimit -Hn; LimitNOFILE= in a systemd unit) or "
                             "use a larger alignment (fewer, larger chunks)");
  }
}

uint64_t random_epoch() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v ? v : 1;
}
}  // namespace detail

}  // namespace leasehold
