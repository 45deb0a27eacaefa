#include "shared/pool_allocator.h"

#include <limits>
#include <stdexcept>
#include <string>

#include "shared/units.h"

namespace leasehold {

PoolAllocator::PoolAllocator(uint64_t pool_size, uint64_t alignment) : alignment_(alignment) {
  if (!is_power_of_two(alignment)) {
    throw std::invalid_argument("pool alignment " + std::to_string(alignment) +
                                " is not a power of two");
  }
  pool_size_ = align_down(pool_size, alignment);
  if (pool_size_ == 0) {
    throw std::invalid_argument("pool of " + std::to_string(pool_size) +
                                " bytes is smaller than one aligned block of " +
                                std::to_string(alignment) + " bytes");
  }
  free_bytes_ = 0;
  insert_free(0, pool_size_);
}

uint64_t PoolAllocator::round_up(uint64_t size) const { return align_up(size, alignment_); }

bool PoolAllocator::could_ever_fit(uint64_t size) const {
  uint64_t r = round_up(size);
  return size > 0 && r != 0 && r <= pool_size_;
}

uint64_t PoolAllocator::largest_free() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

void PoolAllocator::insert_free(uint64_t offset, uint64_t size) {
  blocks_[offset] = Info{size, true};
  free_by_size_.emplace(size, offset);
  free_bytes_ += size;
}

void PoolAllocator::erase_free(BlockMap::iterator it) {
  free_by_size_.erase({it->second.size, it->first});
  free_bytes_ -= it->second.size;
  blocks_.erase(it);
}

std::optional<PoolAllocator::Block> PoolAllocator::allocate(uint64_t size, End end) {
  if (size == 0) throw std::invalid_argument("allocation of 0 bytes");
  uint64_t need = round_up(size);
  if (need == 0) return std::nullopt;
  // Smallest free block with size >= need; among blocks of that size the
  // lowest offset (low end) or the highest offset (high end).
  auto fit = free_by_size_.lower_bound({need, 0});
  if (fit == free_by_size_.end()) return std::nullopt;
  if (end == End::High) {
    auto last = free_by_size_.upper_bound({fit->first, std::numeric_limits<uint64_t>::max()});
    fit = std::prev(last);
  }
  auto [block_size, block_offset] = *fit;
  auto it = blocks_.find(block_offset);
  erase_free(it);
  uint64_t rest = block_size - need;
  uint64_t offset = block_offset;
  if (end == End::Low) {
    if (rest) insert_free(block_offset + need, rest);
  } else {
    offset = block_offset + rest;
    if (rest) insert_free(block_offset, rest);
  }
  blocks_[offset] = Info{need, false};
  return Block{offset, need};
}

std::optional<PoolAllocator::Block> PoolAllocator::allocate_at(uint64_t offset, uint64_t size) {
  if (size == 0) throw std::invalid_argument("allocation of 0 bytes");
  const uint64_t need = round_up(size);
  if (need == 0 || offset % alignment_ != 0 || offset > pool_size_ || need > pool_size_ - offset) {
    return std::nullopt;
  }
  auto it = blocks_.upper_bound(offset);
  if (it == blocks_.begin()) return std::nullopt;
  --it;
  const uint64_t block_offset = it->first, block_size = it->second.size;
  if (!it->second.free || offset + need > block_offset + block_size) return std::nullopt;
  erase_free(it);
  if (offset > block_offset) insert_free(block_offset, offset - block_offset);
  if (const uint64_t tail = block_offset + block_size - (offset + need)) {
    insert_free(offset + need, tail);
  }
  blocks_[offset] = Info{need, false};
  return Block{offset, need};
}

PoolAllocator::BlockMap::iterator PoolAllocator::coalesce(BlockMap::iterator it) {
  uint64_t offset = it->first;
  uint64_t size = it->second.size;
  if (it != blocks_.begin()) {
    auto prev = std::prev(it);
    if (prev->second.free) {
      offset = prev->first;
      size += prev->second.size;
      erase_free(prev);
    }
  }
  auto next = blocks_.find(it->first);
  next = std::next(next);
  if (next != blocks_.end() && next->second.free) {
    size += next->second.size;
    erase_free(next);
  }
  erase_free(blocks_.find(it->first));
  insert_free(offset, size);
  return blocks_.find(offset);
}

void PoolAllocator::free(uint64_t offset) {
  auto it = blocks_.find(offset);
  if (it == blocks_.end() || it->second.free) {
    throw std::invalid_argument("no allocated block at offset " + std::to_string(offset));
  }
  uint64_t size = it->second.size;
  blocks_.erase(it);
  insert_free(offset, size);
  coalesce(blocks_.find(offset));
}

std::optional<uint64_t> PoolAllocator::resize(uint64_t offset, uint64_t new_size) {
  auto it = blocks_.find(offset);
  if (it == blocks_.end() || it->second.free) {
    throw std::invalid_argument("no allocated block at offset " + std::to_string(offset));
  }
  if (new_size == 0) throw std::invalid_argument("resize to 0 bytes");
  uint64_t need = round_up(new_size);
  if (need == 0) return std::nullopt;
  uint64_t have = it->second.size;
  if (need == have) return need;
  if (need < have) {
    it->second.size = need;
    insert_free(offset + need, have - need);
    coalesce(blocks_.find(offset + need));
    return need;
  }
  auto next = std::next(it);
  uint64_t extra = need - have;
  if (next == blocks_.end() || !next->second.free || next->second.size < extra) {
    return std::nullopt;
  }
  uint64_t next_offset = next->first;
  uint64_t next_size = next->second.size;
  erase_free(next);
  if (next_size > extra) insert_free(next_offset + extra, next_size - extra);
  blocks_[offset].size = need;
  return need;
}

std::vector<PoolAllocator::Block> PoolAllocator::free_blocks() const {
  std::vector<Block> out;
  for (const auto& [offset, info] : blocks_) {
    if (info.free) out.push_back({offset, info.size});
  }
  return out;
}

std::vector<PoolAllocator::Block> PoolAllocator::used_blocks() const {
  std::vector<Block> out;
  for (const auto& [offset, info] : blocks_) {
    if (!info.free) out.push_back({offset, info.size});
  }
  return out;
}

}  // namespace leasehold
