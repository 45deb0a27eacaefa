// An allocator that counts what passes through it to the one it wraps,
// with a peak that starts again on request, and tells a test of each
// allocation and free (on_allocate, on_free): what tests measure an
// operator's or a step's memory with. The test's thread only.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>

#include "agent/engine/allocator.h"

namespace leasehold::engine {

class CountingAllocator final : public Allocator {
 public:
  explicit CountingAllocator(std::shared_ptr<Allocator> inner) : inner_(std::move(inner)) {}
  void* allocate(size_t bytes) override {
    if (on_allocate) on_allocate(bytes);
    void* p = inner_->allocate(bytes);
    in_use_ += bytes;
    allocated_ += bytes;
    peak_ = std::max(peak_, in_use_);
    return p;
  }
  void deallocate(void* ptr, size_t bytes) noexcept override {
    inner_->deallocate(ptr, bytes);
    in_use_ -= bytes;
    if (on_free) on_free(ptr, bytes);
  }
  Device device() const override { return inner_->device(); }
  // The inner allocator's, with bytes in use and the peak as counted here.
  AllocatorStats stats() const override {
    AllocatorStats s = inner_->stats();
    s.in_use_bytes = in_use_;
    s.peak_in_use_bytes = peak_;
    return s;
  }
  void restart_peak() { peak_ = in_use_; }
  // Every byte allocated through it, summed.
  uint64_t allocated() const { return allocated_; }
  // Called before each allocation with its size, and after each free with
  // its address and size, when set.
  std::function<void(size_t bytes)> on_allocate;
  std::function<void(void* ptr, size_t bytes)> on_free;

 private:
  std::shared_ptr<Allocator> inner_;
  uint64_t in_use_ = 0, peak_ = 0, allocated_ = 0;
};

}  // namespace leasehold::engine
