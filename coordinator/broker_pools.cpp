// The broker's device pools: which devices it serves, how large each pool
// is, and its chunk size (coordinator/broker.h).
#include <spdlog/spdlog.h>

#include <stdexcept>
#include <string>

#include "coordinator/broker.h"
#include "shared/units.h"

namespace leasehold {

void Broker::create_pools(Backend backend) {
  std::vector<int> ordinals = opts_.devices;
  if (backend == Backend::Host) {
    if (!ordinals.empty()) {
      spdlog::warn("devices is for the cuda backend; the host backend serves host_devices = {}",
                   opts_.host_devices);
    }
    ordinals.clear();
    for (int i = 0; i < opts_.host_devices; ++i) ordinals.push_back(i);
  } else if (ordinals.empty()) {
    for (int i = 0; i < cuda_device_count(); ++i) ordinals.push_back(i);
    if (ordinals.empty()) throw std::runtime_error("the cuda backend sees no CUDA device");
  } else {
    const int visible = cuda_device_count();
    for (int ordinal : ordinals) {
      if (visible == 0) throw std::runtime_error("devices: no CUDA device is visible");
      if (ordinal >= visible) {
        throw std::runtime_error("devices: device " + std::to_string(ordinal) +
                                 " is not visible (" + std::to_string(visible) +
                                 " CUDA devices: 0 to " + std::to_string(visible - 1) +
                                 "; CUDA_VISIBLE_DEVICES renumbers them)");
      }
    }
  }
  if (opts_.pool_size.size() > 1 && opts_.pool_size.size() != ordinals.size()) {
    throw std::runtime_error("pool_size lists " + std::to_string(opts_.pool_size.size()) +
                             " sizes for the " + std::to_string(ordinals.size()) +
                             " devices served: give one for all, or one per device");
  }
  for (size_t i = 0; i < ordinals.size(); ++i) {
    const int ordinal = ordinals[i];
    const SizeSpec& spec = opts_.pool_size[opts_.pool_size.size() > 1 ? i : 0];
    DeviceMemory mem = query_device_memory(backend, ordinal);
    // Host devices share the host's memory: a share is of their part of it.
    const uint64_t free =
        backend == Backend::Host ? mem.free_bytes / ordinals.size() : mem.free_bytes;
    const std::string where =
        mem.name + (backend == Backend::Cuda ? " (device " + std::to_string(ordinal) + ")" : "");
    // Leases are mapped as whole chunks of the alignment: it is at least
    // the backend's mapping granularity (2 MiB on current GPUs).
    uint64_t alignment = opts_.alignment;
    const uint64_t granularity = chunk_granularity(backend, ordinal);
    if (alignment % granularity != 0) {
      alignment = align_up(alignment, granularity);
      spdlog::warn(
          "device {}: alignment {} raised to {}, the {} backend's mapping granularity (each "
          "lease is mapped as whole chunks of the alignment)",
          ordinal, format_bytes(opts_.alignment), format_bytes(alignment), backend_name(backend));
    }
    uint64_t size = align_down(spec.resolve(free), alignment);
    if (size == 0) {
      throw std::runtime_error("pool size " + spec.to_string() + " of " + format_bytes(free) +
                               " free on " + where + " is less than one aligned block of " +
                               format_bytes(alignment));
    }
    if (spec.percent == 0 && size > free) {
      throw std::runtime_error("pool size " + format_bytes(size) + " exceeds the " +
                               format_bytes(free) + " free on " + where);
    }
    const auto made = Clock::now();
    try {
      device_pools_.push_back(create_pool(backend, ordinal, size, alignment));
    } catch (const std::exception& e) {
      if (!mps_) throw;
      throw std::runtime_error(std::string(e.what()) +
                               " (under MPS the pool lives outside the MPS server: the GPU must "
                               "be in the Default compute mode, not Exclusive-process)");
    }
    const PoolDescriptor& pool = device_pools_.back()->descriptor();
    spdlog::info("device {}: pool of {} of {} free on {} ({}), {} chunks of {} made in {} ms",
                 ordinal, format_bytes(size), format_bytes(free), where, pool.uuid,
                 pool.chunk_count(), format_bytes(alignment), ms_between(made, Clock::now()));
  }
}

}  // namespace leasehold
