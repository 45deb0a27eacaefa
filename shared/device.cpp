#include "shared/device.h"

#include <random>
#include <stdexcept>

#include "shared/detail/backends.h"

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

std::unique_ptr<DevicePool> create_pool(Backend backend, int device, uint64_t size,
                                        uint64_t alignment, std::string_view name) {
  if (backend == Backend::Host) return detail::create_host_pool(device, size, alignment, name);
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::create_cuda_pool(device, size, alignment);
#else
  (void)device;
  throw std::runtime_error("cannot create a CUDA pool: this build has no CUDA support");
#endif
}

std::unique_ptr<PoolMapping> map_pool(const PoolDescriptor& desc) {
  if (desc.backend == Backend::Host) return detail::map_host_pool(desc);
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::map_cuda_pool(desc);
#else
  throw std::runtime_error("cannot map a CUDA pool: this build has no CUDA support");
#endif
}

namespace detail {
uint64_t random_epoch() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  return v ? v : 1;
}
}  // namespace detail

}  // namespace leasehold
