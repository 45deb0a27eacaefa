// The device layer: the only code that differs between the host and CUDA
// backends. The coordinator creates one DevicePool per device it serves at
// start, as chunks of physical memory; each process reserves its device's
// pool range once through a PoolMapping and maps into it exactly the
// chunks of its leases and regions. Everything above works on offsets.
//
// Thread safety: a DevicePool is not shared between threads without
// external locking; a PoolMapping and the free functions are thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "shared/unique_fd.h"

namespace leasehold {

enum class Backend { Host, Cuda };

const char* backend_name(Backend b);
// "host" / "cuda"; nullopt for anything else ("auto" is resolved by
// resolve_backend).
std::optional<Backend> parse_backend(std::string_view text);
// "auto" → cuda when this build has CUDA and a device is visible, else host.
// Throws std::runtime_error when "cuda" is asked for but not available.
Backend resolve_backend(std::string_view text);

// True when this binary was built with the CUDA backend.
bool cuda_built();
// Visible CUDA devices; 0 when none or when built without CUDA.
int cuda_device_count();
// This process's ordinal of the GPU whose UUID is `uuid` ("GPU-8d6c..."):
// what another process calls device 1 may be this one's 0
// (CUDA_VISIBLE_DEVICES). -1 when no visible GPU has it.
int cuda_ordinal_of(std::string_view uuid);

struct DeviceMemory {
  uint64_t free_bytes = 0;
  uint64_t total_bytes = 0;
  std::string name;  // "NVIDIA H100 80GB HBM3", "host shared memory"
  // "GPU-8d6c...", as nvidia-smi and DCGM's exporter write it; empty on host.
  std::string uuid;
};
// Free and total memory of the device: cudaMemGetInfo on cuda; on host, the
// smaller of MemAvailable and the free space of /dev/shm.
DeviceMemory query_device_memory(Backend backend, int device);

// What a process needs to map chunks of a pool. The memory itself reaches
// a process only as the file descriptors of the chunks it was granted
// (shared/chunk_channel.h): nobody maps the whole pool.
struct PoolDescriptor {
  Backend backend = Backend::Host;
  int device = 0;
  std::string device_name;
  uint64_t size = 0;       // a whole number of chunks
  uint64_t alignment = 0;  // the chunk size: every lease and region is whole chunks
  uint64_t epoch = 0;      // random per pool; tells pools apart
  // The GPU's UUID ("GPU-8d6c..."); "host-N" for the host backend's device N.
  std::string uuid;

  uint64_t chunk_count() const { return alignment ? size / alignment : 0; }
};

// How a process may touch the chunks it maps: a region's filler and a
// lease's holder write, every other attacher of a region only reads.
enum class Access : uint8_t { ReadOnly = 1, ReadWrite = 2 };
const char* access_name(Access a);

// The pool, owned by the coordinator: physical memory allocated once at
// start as `size / alignment` chunks, each shareable through a file
// descriptor (host: a sealed memfd; cuda: cuMemCreate memory exported as a
// POSIX file descriptor). Freed in the destructor (which never throws).
class DevicePool {
 public:
  virtual ~DevicePool() = default;
  const PoolDescriptor& descriptor() const { return desc_; }
  uint64_t chunk_count() const { return chunk_fds_.size(); }
  // The descriptor that shares chunk `i` now (owned by the pool: a receiver
  // of SCM_RIGHTS gets a copy of its own; renew() replaces it). Throws
  // std::out_of_range past the last chunk.
  int chunk_fd(uint64_t i) const { return chunk_fds_.at(i).get(); }
  // A descriptor to hand a process granted chunk `i` with `access` (the
  // caller closes it once sent). On host a read-only grant gets the chunk
  // opened read-only, which mmap refuses to map for writing; a CUDA handle
  // carries no access of its own (the importer sets it). Throws
  // std::runtime_error when the process is out of descriptors, or the
  // chunk has no memory (a renewal failed). Thread-safe.
  UniqueFd share(uint64_t i, Access access) const;
  // Gives chunks [first, first + count) new memory: whoever kept a map or a
  // descriptor of the old memory (a process that gave its lease back but
  // not the memory) keeps only that, out of everyone else's reach; memory
  // nobody kept is freed. Nobody may be granted these chunks meanwhile.
  // Thread-safe against share(). Throws std::runtime_error naming the
  // chunk when new memory cannot be had (the old was kept, and the device
  // is full): the chunks before it are renewed, it and the rest must not
  // be handed out again.
  void renew(uint64_t first, uint64_t count);

 protected:
  // Backend work, with the descriptors' lock held: share()'s (by default a
  // duplicate of the chunk's descriptor), and renew()'s for one chunk,
  // which leaves chunk_fds_[i] the new memory's descriptor (or invalid when
  // it throws).
  virtual UniqueFd share_chunk(uint64_t i, Access access) const;
  virtual void renew_chunk(uint64_t i) = 0;

  PoolDescriptor desc_;
  std::vector<UniqueFd> chunk_fds_;  // GUARDED_BY(fds_mu_) once the pool is made

 private:
  mutable std::mutex fds_mu_;
};

// The smallest chunk `backend` can map on `device`: the page size on host,
// cuMemGetAllocationGranularity on cuda. Throws std::runtime_error when the
// backend is not built or the device cannot say.
uint64_t chunk_granularity(Backend backend, int device);

// Allocates a pool of `size` bytes (rounded down to whole chunks of
// `alignment`) on `device`. Throws std::invalid_argument when `alignment`
// is not a multiple of chunk_granularity, and std::runtime_error naming
// the size and the backend when the memory cannot be had (or the process
// may not hold one file descriptor per chunk).
std::unique_ptr<DevicePool> create_pool(Backend backend, int device, uint64_t size,
                                        uint64_t alignment);

// A pool's address range in this process (agent side): reserved whole at
// construction, with only the chunks this process was granted mapped into
// it. Chunk i is at base() + i * alignment while it is mapped; every other
// address of the range faults. Thread-safe.
class PoolMapping {
 public:
  virtual ~PoolMapping() = default;
  const PoolDescriptor& descriptor() const { return desc_; }
  // Base address: a device pointer on cuda, a host pointer on host.
  std::byte* base() const { return base_; }

  // Maps chunks [first, first + fds.size()) from their descriptors, which
  // it consumes (the mapping keeps the memory). Maps are counted per chunk
  // and access: a chunk mapped again is not mapped twice, and it is
  // writable while any of its maps is. Throws std::out_of_range outside
  // the pool and std::runtime_error when the backend refuses (nothing of
  // this call stays mapped then).
  void map(uint64_t first, std::vector<UniqueFd> fds, Access access);
  // Undoes one map of chunks [first, first + count) with `access`: a chunk
  // whose last map this was becomes unreachable. Never throws (a failure
  // is logged).
  void unmap(uint64_t first, uint64_t count, Access access) noexcept;
  // Turns one read-write map of chunks [first, first + count) into a
  // read-only one (a filled region): a chunk no other map writes becomes
  // read-only. Never throws (a failure is logged).
  void narrow(uint64_t first, uint64_t count) noexcept;
  // Unmaps every chunk still mapped, whoever mapped it (a session that
  // ends while leases of it live; a backend's destructor). Later unmaps of
  // those maps find nothing to undo.
  void unmap_all() noexcept;
  // How chunk `i` is mapped now (nullopt: it is not).
  std::optional<Access> access(uint64_t i) const;

 protected:
  PoolMapping() = default;
  // Backend work, called with the mapping's lock held. Maps the run of
  // chunks [first, first + fds.size()), none of them mapped now, with
  // `access`: all or nothing (on failure none of them stays mapped).
  virtual void map_chunks(uint64_t first, const std::vector<int>& fds, Access access) = 0;
  virtual void protect_chunk(uint64_t i, Access access) = 0;
  // A chunk mapped read-only becomes writable through `fd` (a read-write
  // grant). By default the access is changed in place.
  virtual void widen_chunk(uint64_t i, int fd) {
    (void)fd;
    protect_chunk(i, Access::ReadWrite);
  }
  // The run [first, first + count) becomes unreachable.
  virtual void unmap_chunks(uint64_t first, uint64_t count) noexcept = 0;

  PoolDescriptor desc_;
  std::byte* base_ = nullptr;

 private:
  struct Maps {
    uint32_t read_only = 0, read_write = 0;
  };
  // unmap()'s work. REQUIRES: mu_ held.
  void unmap_locked(uint64_t first, uint64_t count, Access access) noexcept;

  mutable std::mutex mu_;
  std::vector<Maps> maps_;  // per chunk; sized on the first map
};

// Reserves the address range of the pool that `desc` describes, with no
// chunk mapped. Throws std::runtime_error naming the pool and the reason
// (backend not built, device not visible, no address space).
std::unique_ptr<PoolMapping> map_pool(const PoolDescriptor& desc);

}  // namespace leasehold
