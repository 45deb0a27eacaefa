// Backend entry points behind shared/device.h. Not part of the interface.
#pragma once

#include "shared/chunk_window.h"
#include "shared/device.h"

namespace leasehold::detail {

uint64_t host_granularity();
std::unique_ptr<DevicePool> create_host_pool(int device, uint64_t size, uint64_t alignment);
std::unique_ptr<PoolMapping> map_host_pool(const PoolDescriptor& desc);
std::unique_ptr<ChunkWindow> open_host_window(std::shared_ptr<PoolMapping> source, uint64_t pages);
DeviceMemory query_host_memory();

#ifdef LEASEHOLD_HAVE_CUDA
uint64_t cuda_granularity(int device);
std::unique_ptr<DevicePool> create_cuda_pool(int device, uint64_t size, uint64_t alignment);
std::unique_ptr<PoolMapping> map_cuda_pool(const PoolDescriptor& desc);
std::unique_ptr<ChunkWindow> open_cuda_window(std::shared_ptr<PoolMapping> source, uint64_t pages);
DeviceMemory query_cuda_memory(int device);
int cuda_visible_devices();
int cuda_ordinal_of(std::string_view uuid);
#endif

uint64_t random_epoch();

// Makes sure this process may hold `needed` more file descriptors (one per
// chunk of a pool), raising its soft limit up to the hard one when it must.
// Throws std::runtime_error naming both numbers and what to change.
void reserve_descriptors(uint64_t needed, const std::string& what);

}  // namespace leasehold::detail
