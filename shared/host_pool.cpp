// Host backend: the pool is a POSIX shared memory segment, created by the
// coordinator and mapped by each agent. The segment's name is derived from the
// coordinator's name hint, so a segment left behind by a crashed coordinator
// is found and removed at the next start instead of leaking.
#include <spdlog/spdlog.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <boost/interprocess/mapped_region.hpp>
#include <boost/interprocess/shared_memory_object.hpp>
#include <fstream>
#include <functional>
#include <sstream>
#include <stdexcept>
#include <string>

#include "shared/detail/backends.h"
#include "shared/units.h"

namespace bip = boost::interprocess;

namespace leasehold::detail {
namespace {

std::string segment_name(std::string_view hint) {
  std::ostringstream os;
  os << "leasehold-" << getuid() << "-" << std::hex << std::hash<std::string_view>{}(hint);
  return os.str();
}

class HostPool final : public DevicePool {
 public:
  HostPool(int device, uint64_t size, uint64_t alignment, std::string name)
      : name_(std::move(name)) {
    if (bip::shared_memory_object::remove(name_.c_str())) {
      spdlog::warn("removed stale shared memory segment /dev/shm/{} left by an earlier run", name_);
    }
    try {
      // Owner only (Boost's default is 0644: every local user could read
      // and map the pool). Agents run as the coordinator's user.
      segment_ = bip::shared_memory_object(bip::create_only, name_.c_str(), bip::read_write,
                                           bip::permissions(0600));
      segment_.truncate(static_cast<bip::offset_t>(size));
      region_ = bip::mapped_region(segment_, bip::read_write, 0, size);
    } catch (const bip::interprocess_exception& e) {
      bip::shared_memory_object::remove(name_.c_str());
      throw std::runtime_error("cannot create a host pool of " + format_bytes(size) +
                               " in shared memory segment " + name_ + ": " + e.what());
    }
    desc_.backend = Backend::Host;
    desc_.device = device;
    desc_.device_name = "host shared memory";
    desc_.uuid = "host-" + std::to_string(device);
    desc_.size = size;
    desc_.alignment = alignment;
    desc_.handle.assign(name_.begin(), name_.end());
    desc_.epoch = random_epoch();
  }
  ~HostPool() override {
    // Agents that still have the segment mapped keep their mapping; removing
    // the name only stops new mappings.
    region_ = bip::mapped_region();
    bip::shared_memory_object::remove(name_.c_str());
  }

 private:
  std::string name_;
  bip::shared_memory_object segment_;
  bip::mapped_region region_;
};

class HostMapping final : public PoolMapping {
 public:
  explicit HostMapping(const PoolDescriptor& desc) {
    std::string name(desc.handle.begin(), desc.handle.end());
    try {
      bip::shared_memory_object segment(bip::open_only, name.c_str(), bip::read_write);
      bip::offset_t actual = 0;
      if (!segment.get_size(actual) || static_cast<uint64_t>(actual) < desc.size) {
        throw std::runtime_error("segment is " + std::to_string(actual) + " bytes, expected " +
                                 std::to_string(desc.size));
      }
      region_ = bip::mapped_region(segment, bip::read_write, 0, desc.size);
    } catch (const std::exception& e) {
      throw std::runtime_error("cannot map host pool segment /dev/shm/" + name + ": " + e.what());
    }
    desc_ = desc;
    base_ = static_cast<std::byte*>(region_.get_address());
  }

 private:
  bip::mapped_region region_;
};

uint64_t meminfo_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (in >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

}  // namespace

std::unique_ptr<DevicePool> create_host_pool(int device, uint64_t size, uint64_t alignment,
                                             std::string_view name) {
  // Device 0 keeps the name it always had; the others' differ by their ordinal.
  const std::string hint =
      device == 0 ? std::string(name) : std::string(name) + "#device" + std::to_string(device);
  return std::make_unique<HostPool>(device, size, alignment, segment_name(hint));
}

std::unique_ptr<PoolMapping> map_host_pool(const PoolDescriptor& desc) {
  return std::make_unique<HostMapping>(desc);
}

DeviceMemory query_host_memory() {
  DeviceMemory m;
  m.name = "host shared memory";
  struct statvfs vfs {};
  uint64_t shm_free = 0, shm_total = 0;
  if (statvfs("/dev/shm", &vfs) == 0) {
    shm_free = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    shm_total = static_cast<uint64_t>(vfs.f_blocks) * vfs.f_frsize;
  }
  uint64_t avail = meminfo_available();
  m.free_bytes = (avail && shm_free) ? std::min(avail, shm_free) : std::max(avail, shm_free);
  m.total_bytes = shm_total;
  return m;
}

}  // namespace leasehold::detail
