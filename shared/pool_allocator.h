// Offset-based allocator: the coordinator places leases in the device pool
// with it, and agents place tensors inside each lease. It never touches memory: it
// hands out [offset, offset + size) ranges of a pool of fixed size.
//
// Placement policy: best fit (the smallest free block that is large enough),
// ties broken toward the requested end, and the range is cut from that end of
// the chosen block. Requests for the low end therefore pack from offset 0
// upward and requests for the high end from the top downward, as FlashNeuron's
// device_malloc / device_malloc_reverse do, so long-lived regions and
// short-lived scratch fragment each other less. Best fit is used rather than
// "lowest/highest address that fits" because it can be found in O(log n) with
// ordered sets and keeps large blocks intact for large requests.
//
// All operations are O(log n) in the number of blocks. Freed ranges are
// coalesced with free neighbours at once, so the free list never holds two
// adjacent blocks.
//
// Thread safety: none; the coordinator's single loop owns it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <utility>
#include <vector>

namespace leasehold {

class PoolAllocator {
 public:
  enum class End { Low, High };
  struct Block {
    uint64_t offset = 0;
    uint64_t size = 0;
    bool operator==(const Block&) const = default;
  };

  // REQUIRES: alignment is a power of two. The usable size is `pool_size`
  // rounded down to the alignment. Throws std::invalid_argument when the
  // alignment is not a power of two or the pool is smaller than one block.
  PoolAllocator(uint64_t pool_size, uint64_t alignment);

  // Allocates `size` bytes rounded up to the alignment. Returns the block, or
  // nullopt when no free block is large enough now. Throws
  // std::invalid_argument for size 0.
  std::optional<Block> allocate(uint64_t size, End end);

  // Allocates exactly [offset, offset + size rounded up) when that range is
  // free (inside one free block); nullopt otherwise, or when `offset` is not
  // a multiple of the alignment. Throws std::invalid_argument for size 0.
  std::optional<Block> allocate_at(uint64_t offset, uint64_t size);

  // Frees the block that starts at `offset`. Throws std::invalid_argument when
  // no allocated block starts there.
  void free(uint64_t offset);

  // Resizes the allocated block at `offset` in place to `new_size` rounded up
  // to the alignment: shrinking always succeeds (the tail is freed); growing
  // succeeds only when the block that follows is free and large enough.
  // Returns the new size, or nullopt when growing in place is impossible.
  // Throws std::invalid_argument for an unknown offset or size 0.
  std::optional<uint64_t> resize(uint64_t offset, uint64_t new_size);

  // `size` rounded up to the alignment; 0 when that overflows.
  uint64_t round_up(uint64_t size) const;
  // True when a request of `size` could be served by an empty pool.
  bool could_ever_fit(uint64_t size) const;

  uint64_t pool_size() const { return pool_size_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t used_bytes() const { return pool_size_ - free_bytes_; }
  uint64_t free_bytes() const { return free_bytes_; }
  uint64_t largest_free() const;
  size_t free_block_count() const { return free_by_size_.size(); }
  size_t used_block_count() const { return blocks_.size() - free_by_size_.size(); }

  // Snapshots ordered by offset (for status output and tests).
  std::vector<Block> free_blocks() const;
  std::vector<Block> used_blocks() const;

 private:
  struct Info {
    uint64_t size;
    bool free;
  };
  using BlockMap = std::map<uint64_t, Info>;

  void insert_free(uint64_t offset, uint64_t size);
  void erase_free(BlockMap::iterator it);
  // Merges the free block at `it` with free neighbours; returns the merged one.
  BlockMap::iterator coalesce(BlockMap::iterator it);

  uint64_t pool_size_;
  uint64_t alignment_;
  uint64_t free_bytes_;
  BlockMap blocks_;                                    // every block, by offset
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, offset) of free blocks
};

}  // namespace leasehold
