// Gives chunks of the pools new memory (DevicePool::renew) off the
// coordinator's loop, one lease at a time, for the memory a program job's
// session gave back (coordinator/core_renewals.cpp says why). Making and
// exporting a chunk's memory takes most of a millisecond on CUDA, and a
// 1 GiB lease is 512 chunks: the loop must not wait for that.
//
// Thread safety: renew and take_done from the loop's thread; one worker
// thread does the renewals.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coordinator/effects.h"
#include "shared/device.h"

namespace leasehold {

class ChunkRenewer {
 public:
  struct Done {
    int device = 0;
    uint64_t lease_id = 0;
    std::string error;  // empty: renewed
  };

  // `pool_of(ordinal)` finds a device's pool (null: none), and the pools
  // outlive this object; `notify` runs on the worker after each renewal
  // (to wake the loop).
  ChunkRenewer(std::function<DevicePool*(int)> pool_of, std::function<void()> notify);
  // Finishes the renewal under way and drops the rest (the coordinator
  // stops: its pools go with it). Never throws.
  ~ChunkRenewer();
  ChunkRenewer(const ChunkRenewer&) = delete;
  ChunkRenewer& operator=(const ChunkRenewer&) = delete;

  void renew(const ChunkRenewal& r);
  // Renewals finished since the last call.
  std::vector<Done> take_done();

 private:
  void work();

  const std::function<DevicePool*(int)> pool_of_;
  const std::function<void()> notify_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<ChunkRenewal> queue_;  // GUARDED_BY(mu_)
  std::vector<Done> done_;          // GUARDED_BY(mu_)
  bool stop_ = false;               // GUARDED_BY(mu_)
  std::thread worker_;              // last: started once the rest is ready
};

}  // namespace leasehold
