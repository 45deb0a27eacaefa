#include "agent/engine/trace_addresses.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
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
    : device_(device),
      bytes_(round_up(std::max<uint64_t>(bytes, 1), kReserveGranule)),
      places_(bytes_, kAlignment) {
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
  const auto block = places_.allocate(std::max<uint64_t>(bytes, 1), PoolAllocator::End::Low);
  if (!block) {
    throw OutOfMemoryError("a traced step's tensors need more than the " + format_bytes(bytes_) +
                               " of addresses reserved for its trace (" + format_bytes(bytes) +
                               " more asked)",
                           bytes);
  }
  return base_ + block->offset;
}

void TraceAddresses::give_back(void* p) {
  places_.free(static_cast<uint64_t>(static_cast<char*>(p) - base_));
}

}  // namespace leasehold::engine
