#include "coordinator/chunk_renewer.h"

#include <exception>

namespace leasehold {

ChunkRenewer::ChunkRenewer(std::function<DevicePool*(int)> pool_of, std::function<void()> notify)
    : pool_of_(std::move(pool_of)), notify_(std::move(notify)), worker_([this] { work(); }) {}

ChunkRenewer::~ChunkRenewer() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void ChunkRenewer::renew(const ChunkRenewal& r) {
  {
    std::lock_guard lock(mu_);
    queue_.push_back(r);
  }
  cv_.notify_one();
}

std::vector<ChunkRenewer::Done> ChunkRenewer::take_done() {
  std::lock_guard lock(mu_);
  return std::exchange(done_, {});
}

void ChunkRenewer::work() {
  for (;;) {
    ChunkRenewal r;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (stop_) return;
      r = queue_.front();
      queue_.pop_front();
    }
    Done d{r.device, r.lease_id, {}};
    try {
      DevicePool* pool = pool_of_(r.device);
      if (pool == nullptr) {
        d.error = "no pool on device " + std::to_string(r.device);
      } else {
        pool->renew(r.first, r.count);
      }
    } catch (const std::exception& e) {
      d.error = e.what();
    }
    {
      std::lock_guard lock(mu_);
      done_.push_back(std::move(d));
    }
    notify_();
  }
}

}  // namespace leasehold
