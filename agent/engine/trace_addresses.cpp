#include "agent/engine/trace_addresses.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iterator>
#include <stdexcept>

#include "agent/engine/allocator.h"
#include "shared/units.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include "shared/cuda_vmm.h"
#endif

namespace leasehold::engine {
namespace {

uint64_t round_up(uint64_t n, uint64_t to) { return (n + to - 1) / to * to; }

// A reservation's size: a multiple of the largest granularity it may need
// (2 MiB: CUDA's usual; the CPU's pages divide it).
constexpr uint64_t kReserveGranule = 2ull << 20;

}  // namespace

TraceAddresses::TraceAddresses(Device device, uint64_t bytes)
    : device_(device), bytes_(round_up(std::max<uint64_t>(bytes, 1), kReserveGranule)) {
  if (device_.is_cuda()) {
#ifdef LEASEHOLD_HAVE_CUDA
    CUdeviceptr p = 0;
    const CUresult r = detail::cuda_vmm().address_reserve(&p, bytes_, 0, 0, 0);
    if (r != CUDA_SUCCESS) {
      throw std::runtime_error("cannot reserve " + format_bytes(bytes_) +
                               " of device addresses to trace a step: " +
                               detail::vmm_error("cuMemAddressReserve", r));
    }
    base_ = reinterpret_cast<char*>(p);
#else
    throw std::runtime_error("this build has no CUDA");
#endif
  } else {
    void* p = mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      throw std::runtime_error("cannot reserve " + format_bytes(bytes_) +
                               " of addresses to trace a step: " + std::strerror(errno));
    }
    base_ = static_cast<char*>(p);
  }
}

TraceAddresses::~TraceAddresses() {
  if (device_.is_cuda()) {
#ifdef LEASEHOLD_HAVE_CUDA
    (void)detail::cuda_vmm().address_free(reinterpret_cast<CUdeviceptr>(base_), bytes_);
#endif
  } else {
    munmap(base_, bytes_);
  }
}

void* TraceAddresses::take(uint64_t bytes) {
  const uint64_t size = round_up(std::max<uint64_t>(bytes, 1), kAlignment);
  if (auto it = free_by_size_.lower_bound({size, 0}); it != free_by_size_.end()) {
    const auto [run, at] = *it;
    free_by_size_.erase(it);
    free_at_.erase(at);
    if (run > size) {
      free_at_.emplace(at + size, run - size);
      free_by_size_.emplace(run - size, at + size);
    }
    return base_ + at;
  }
  if (size > bytes_ - next_) {
    throw OutOfMemoryError("a traced step's tensors need more than the " + format_bytes(bytes_) +
                               " of addresses reserved for its trace",
                           bytes);
  }
  void* p = base_ + next_;
  next_ += size;
  return p;
}

void TraceAddresses::give_back(void* p, uint64_t bytes) {
  uint64_t at = static_cast<uint64_t>(static_cast<char*>(p) - base_);
  uint64_t size = round_up(std::max<uint64_t>(bytes, 1), kAlignment);
  // (Merged with the runs on either side, which leave both indexes.)
  auto after = free_at_.lower_bound(at);
  if (after != free_at_.end() && after->first == at + size) {
    size += after->second;
    free_by_size_.erase({after->second, after->first});
    after = free_at_.erase(after);
  }
  if (after != free_at_.begin()) {
    auto before = std::prev(after);
    if (before->first + before->second == at) {
      at = before->first;
      size += before->second;
      free_by_size_.erase({before->second, before->first});
      free_at_.erase(before);
    }
  }
  if (at + size == next_) {
    next_ = at;  // (back to the unused end)
    return;
  }
  free_at_.emplace(at, size);
  free_by_size_.emplace(size, at);
}

}  // namespace leasehold::engine
