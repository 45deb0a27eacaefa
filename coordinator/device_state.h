// One device the coordinator serves: its pool, who leases what of it, and
// the shared cache regions placed in it. Leases and regions never cross
// devices: an agent is bound to one device when it registers and leases
// and attaches there only, so each device is a pool of its own with its
// own occupancy (the policy sees one device at a time: PoolView).
//
// Thread safety: none; the coordinator's core owns it.
#pragma once

#include <string>

#include "coordinator/lease_stats.h"
#include "coordinator/lease_table.h"
#include "coordinator/region_table.h"
#include "shared/device.h"

namespace leasehold {

struct DeviceState {
  // The `index`th of `count` devices (lease ids differ across devices).
  DeviceState(PoolDescriptor descriptor, size_t index, size_t count)
      : pool(std::move(descriptor)),
        leases(pool.size, pool.alignment, count, index),
        regions(pool.device) {}

  int ordinal() const { return pool.device; }
  // "device 1" for logs and errors.
  std::string label() const { return "device " + std::to_string(pool.device); }

  PoolDescriptor pool;
  LeaseTable leases;
  RegionTable regions;
  LeaseStats stats;  // what became of lease requests for this pool (the metrics)
};

}  // namespace leasehold
