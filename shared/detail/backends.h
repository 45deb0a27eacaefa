// Backend entry points behind shared/device.h. Not part of the interface.
#pragma once

#include "shared/device.h"

namespace leasehold::detail {

std::unique_ptr<DevicePool> create_host_pool(int device, uint64_t size, uint64_t alignment,
                                             std::string_view name);
std::unique_ptr<PoolMapping> map_host_pool(const PoolDescriptor& desc);
DeviceMemory query_host_memory();

#ifdef LEASEHOLD_HAVE_CUDA
std::unique_ptr<DevicePool> create_cuda_pool(int device, uint64_t size, uint64_t alignment);
std::unique_ptr<PoolMapping> map_cuda_pool(const PoolDescriptor& desc);
DeviceMemory query_cuda_memory(int device);
int cuda_visible_devices();
int cuda_ordinal_of(std::string_view uuid);
#endif

uint64_t random_epoch();

}  // namespace leasehold::detail
