// Host backend: each chunk of the pool is a memfd the coordinator creates
// at start, its size sealed (nobody who is handed it can shrink it under
// the other mappers' feet). A process maps the chunks it was granted into
// a range it reserved (PROT_NONE) for the whole pool; a read-only grant
// comes as a descriptor opened read-only, which mmap refuses to map for
// writing. The memfds live as long as someone holds or maps them: nothing
// is left behind by a crashed coordinator.
#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

#include "shared/detail/backends.h"
#include "shared/units.h"

namespace leasehold::detail {
namespace {

std::string errno_text() { return std::strerror(errno); }

// One chunk's memory: a memfd of `bytes`, its size sealed. Owner read
// only: a process handed a read-only descriptor cannot open it again for
// writing through /proc/self/fd (root aside). Invalid on failure (errno).
UniqueFd make_chunk(uint64_t bytes) {
  UniqueFd fd(::memfd_create("leasehold-chunk", MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (!fd.valid() || ::ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0 ||
      ::fchmod(fd.get(), 0400) != 0 ||
      ::fcntl(fd.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    return UniqueFd();
  }
  return fd;
}

class HostPool final : public DevicePool {
 public:
  HostPool(int device, uint64_t size, uint64_t alignment) {
    const uint64_t chunks = size / alignment;
    reserve_descriptors(chunks, "a host pool of " + format_bytes(size) + " in chunks of " +
                                    format_bytes(alignment));
    chunk_fds_.reserve(chunks);
    for (uint64_t i = 0; i < chunks; ++i) {
      UniqueFd fd = make_chunk(alignment);
      if (!fd.valid()) {
        throw std::runtime_error("cannot create chunk " + std::to_string(i) + " of a host pool of " +
                                 format_bytes(size) + ": " + errno_text());
      }
      chunk_fds_.push_back(std::move(fd));
    }
    desc_.backend = Backend::Host;
    desc_.device = device;
    desc_.device_name = "host shared memory";
    desc_.uuid = "host-" + std::to_string(device);
    desc_.size = size;
    desc_.alignment = alignment;
    desc_.epoch = random_epoch();
  }

 protected:
  UniqueFd share_chunk(uint64_t i, Access access) const override {
    if (access == Access::ReadWrite) return DevicePool::share_chunk(i, access);
    // A new open file description, read-only: what the receiver may do
    // with it is the file's mode, not ours.
    const std::string path = "/proc/self/fd/" + std::to_string(chunk_fd(i));
    UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd.valid()) {
      throw std::runtime_error("cannot open chunk " + std::to_string(i) + " read-only: " +
                               errno_text());
    }
    return fd;
  }
  // A new memfd: the old one's memory lives on only where somebody kept it.
  void renew_chunk(uint64_t i) override {
    chunk_fds_[i].reset();
    UniqueFd fd = make_chunk(desc_.alignment);
    if (!fd.valid()) {
      throw std::runtime_error("cannot give chunk " + std::to_string(i) + " new memory: " +
                               errno_text());
    }
    chunk_fds_[i] = std::move(fd);
  }
};

class HostMapping final : public PoolMapping {
 public:
  explicit HostMapping(const PoolDescriptor& desc) {
    void* p = ::mmap(nullptr, desc.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (p == MAP_FAILED) {
      throw std::runtime_error("cannot reserve " + format_bytes(desc.size) +
                               " of address space for the host pool: " + errno_text());
    }
    desc_ = desc;
    base_ = static_cast<std::byte*>(p);
  }
  ~HostMapping() override {
    unmap_all();
    if (::munmap(base_, desc_.size) != 0) spdlog::warn("munmap of the pool range: {}", errno_text());
  }

 protected:
  void map_chunks(uint64_t first, const std::vector<int>& fds, Access access) override {
    for (uint64_t k = 0; k < fds.size(); ++k) {
      try {
        map_one(first + k, fds[k], access);
      } catch (...) {
        unmap_chunks(first, k + 1);  // MAP_FIXED may have replaced the reservation already
        throw;
      }
    }
  }
  void protect_chunk(uint64_t i, Access access) override {
    if (::mprotect(at(i), desc_.alignment, prot(access)) != 0) {
      throw std::runtime_error("cannot make chunk " + std::to_string(i) + " " +
                               access_name(access) + ": " + errno_text());
    }
  }
  void widen_chunk(uint64_t i, int fd) override {
    // Mapped from a descriptor opened read-only, which mprotect cannot
    // widen: mapped again (the same memory) from the read-write one.
    map_one(i, fd, Access::ReadWrite);
  }
  void unmap_chunks(uint64_t first, uint64_t count) noexcept override {
    // Back to a reservation: the addresses stay this pool's, and fault.
    if (::mmap(at(first), count * desc_.alignment, PROT_NONE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) == MAP_FAILED) {
      spdlog::error("cannot unmap chunks {}+{} of the host pool: {}", first, count, errno_text());
    }
  }

 private:
  void map_one(uint64_t i, int fd, Access access) {
    struct stat st {};
    if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < desc_.alignment) {
      throw std::runtime_error("chunk " + std::to_string(i) + "'s descriptor is not a chunk of " +
                               format_bytes(desc_.alignment));
    }
    if (::mmap(at(i), desc_.alignment, prot(access), MAP_SHARED | MAP_FIXED, fd, 0) == MAP_FAILED) {
      throw std::runtime_error("cannot map chunk " + std::to_string(i) + " " + access_name(access) +
                               ": " + errno_text());
    }
    // A child forked without exec (a data loader's worker) does not keep
    // the chunk once this process gives it back.
    if (::madvise(at(i), desc_.alignment, MADV_DONTFORK) != 0) {
      spdlog::warn("madvise(MADV_DONTFORK) on chunk {}: {}", i, errno_text());
    }
  }
  static int prot(Access a) { return a == Access::ReadWrite ? PROT_READ | PROT_WRITE : PROT_READ; }
  std::byte* at(uint64_t i) const { return base_ + i * desc_.alignment; }
};

// A window's pages show chunks through mremap with an old size of 0, which
// maps the pages of a shared mapping (the chunk's, in the pool range) once
// more at another address: no descriptor is needed, and the memfd's pages
// are the same.
class HostWindow final : public ChunkWindow {
 public:
  HostWindow(std::shared_ptr<PoolMapping> source, std::byte* base, uint64_t pages,
             uint64_t page_size)
      : ChunkWindow(std::move(source), base, pages, page_size) {}
  ~HostWindow() override {
    hide_all();
    if (::munmap(base(), page_count() * page_size()) != 0) {
      spdlog::warn("munmap of a chunk window: {}", errno_text());
    }
  }

 protected:
  void show_pages(uint64_t first, const std::vector<std::byte*>& sources) override {
    for (uint64_t k = 0; k < sources.size(); ++k) {
      void* at = page(first + k);
      if (::mremap(sources[k], 0, page_size(), MREMAP_MAYMOVE | MREMAP_FIXED, at) == MAP_FAILED) {
        const std::string why = errno_text();
        if (k && !hide_pages(first, k).empty()) {
          spdlog::error("a window's pages {}+{} may stay mapped", first, k);
        }
        throw std::runtime_error("cannot show a chunk at page " + std::to_string(first + k) +
                                 " of a window: " + why);
      }
      if (::madvise(at, page_size(), MADV_DONTFORK) != 0) {
        spdlog::warn("madvise(MADV_DONTFORK) on a window page: {}", errno_text());
      }
    }
  }
  std::vector<uint64_t> hide_pages(uint64_t first, uint64_t count) noexcept override {
    if (::mmap(page(first), count * page_size(), PROT_NONE,
               MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) != MAP_FAILED) {
      return {};
    }
    // What the range holds now is unknown: all of it counts as shown.
    spdlog::error("cannot hide pages {}+{} of a window: {}", first, count, errno_text());
    std::vector<uint64_t> stuck;
    for (uint64_t p = first; p < first + count; ++p) stuck.push_back(p);
    return stuck;
  }
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

uint64_t host_granularity() {
  const long page = ::sysconf(_SC_PAGESIZE);
  return page > 0 ? static_cast<uint64_t>(page) : 4096;
}

std::unique_ptr<ChunkWindow> open_host_window(std::shared_ptr<PoolMapping> source, uint64_t pages) {
  const uint64_t page_size = source->descriptor().alignment;
  if (pages > UINT64_MAX / page_size) throw std::invalid_argument("a window past the address space");
  void* p = ::mmap(nullptr, pages * page_size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) {
    throw std::runtime_error("cannot reserve " + format_bytes(pages * page_size) +
                             " of address space for a chunk window: " + errno_text());
  }
  return std::make_unique<HostWindow>(std::move(source), static_cast<std::byte*>(p), pages,
                                      page_size);
}

std::unique_ptr<DevicePool> create_host_pool(int device, uint64_t size, uint64_t alignment) {
  return std::make_unique<HostPool>(device, size, alignment);
}

std::unique_ptr<PoolMapping> map_host_pool(const PoolDescriptor& desc) {
  return std::make_unique<HostMapping>(desc);
}

DeviceMemory query_host_memory() {
  // The chunks are shared memory (shmem) like /dev/shm's files, limited by
  // what the host has available.
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
