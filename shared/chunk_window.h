// A chunk window: an address range of this process, reserved apart from the
// pool's, into which chunks it holds read-write (mapped in its PoolMapping
// by a lease) are mapped again at whatever page the caller chooses. Page p
// shows the physical memory of one chunk, or nothing (it faults).
//
// This is how a job's memory grows without fragmenting (agent/memory/):
// the pages of one contiguous range are backed by chunks from wherever the
// coordinator placed its leases, and a chunk freed in one place of the
// range can back another, so free space is never stranded between live
// tensors in separate leases. PyTorch's expandable segments do the same
// with memory of their own; here the memory is the pool's.
//
// The window shows chunks; it does not hold them. Whoever shows a chunk
// hides it again before the lease that holds the chunk is given back (the
// lease's chunks leave the PoolMapping then, and no other map of them may
// stay in the process). Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace leasehold {

class PoolMapping;

class ChunkWindow {
 public:
  virtual ~ChunkWindow() = default;
  ChunkWindow(const ChunkWindow&) = delete;
  ChunkWindow& operator=(const ChunkWindow&) = delete;

  // The first page's address (a device pointer on cuda).
  std::byte* base() const { return base_; }
  uint64_t page_count() const { return page_count_; }
  // The pool's chunk size.
  uint64_t page_size() const { return page_size_; }
  // The mapping whose chunks it shows.
  const std::shared_ptr<PoolMapping>& source() const { return source_; }

  // Shows chunk chunks[k] at page first + k, read-write, for every k: all
  // or nothing. Throws std::out_of_range for pages past the window or a
  // chunk past the pool, std::logic_error when a page shows a chunk
  // already or a chunk is not mapped read-write in the source mapping
  // (only memory this process may write is shown), and std::runtime_error
  // when the backend refuses.
  void show(uint64_t first, const std::vector<uint64_t>& chunks);
  // Pages [first, first + count) show nothing any more; pages that showed
  // nothing are skipped. Never throws: false when the backend failed to
  // unmap some page (logged), which then still counts as showing its chunk
  // (whoever owns the chunk must not give it away while it may be mapped).
  bool hide(uint64_t first, uint64_t count) noexcept;
  // The chunk page `page` shows; nullopt: none (or past the window).
  std::optional<uint64_t> shown(uint64_t page) const;
  // How many pages show a chunk.
  uint64_t shown_count() const;

 protected:
  ChunkWindow(std::shared_ptr<PoolMapping> source, std::byte* base, uint64_t pages,
              uint64_t page_size);
  // Backend work, with the window's lock held. Maps the memory at
  // sources[k] (a chunk in the source mapping) at page first + k, for
  // every k, read-write; all or nothing.
  virtual void show_pages(uint64_t first, const std::vector<std::byte*>& sources) = 0;
  // The run [first, first + count), all showing a chunk now, faults again.
  // Returns the pages that may still show their chunk (a failure).
  virtual std::vector<uint64_t> hide_pages(uint64_t first, uint64_t count) noexcept = 0;
  // Hides every page still showing a chunk (for the backends' destructors).
  void hide_all() noexcept;
  std::byte* page(uint64_t i) const { return base_ + i * page_size_; }

  std::shared_ptr<PoolMapping> source_;

 private:
  std::byte* base_;
  uint64_t page_count_, page_size_;
  mutable std::mutex mu_;
  std::vector<uint64_t> shown_;  // per page: the chunk + 1, 0 for none
};

// Reserves a window of `pages` pages of `source`'s chunk size on its
// device. Throws std::runtime_error naming the size when the address space
// cannot be had, std::invalid_argument for 0 pages.
std::unique_ptr<ChunkWindow> open_window(std::shared_ptr<PoolMapping> source, uint64_t pages);

}  // namespace leasehold
