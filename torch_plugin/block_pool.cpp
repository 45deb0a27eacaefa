#include "torch_plugin/block_pool.h"

#include <algorithm>

namespace leasehold::torch_plugin::detail {

BlockPool::~BlockPool() {
  for (Segment* seg : segments_) {
    for (Block* b = seg->first; b;) {
      Block* n = b->next;
      delete b;
      b = n;
    }
    delete seg;
  }
}

// ---- segments -------------------------------------------------------------------

Block* BlockPool::add_segment(const Lease& lease, bool small) {
  auto* seg = new Segment;
  seg->lease = lease;
  seg->small = small;
  auto* b = new Block;
  b->addr = reinterpret_cast<uintptr_t>(lease.base);
  b->size = lease.size;
  b->seg = seg;
  b->ready = true;  // nothing ever ran on it
  seg->first = b;
  segments_.insert(seg);
  free_segments_.insert(seg);
  insert_free(b);
  return b;
}

void BlockPool::begin_release(Segment* seg) {
  seg->releasing = true;
  free_segments_.erase(seg);
  for (Block* b = seg->first; b; b = b->next) {
    if (b->state == BState::kUnbacked) continue;
    erase_free(b);
    b->state = BState::kReleasing;
  }
}

void BlockPool::cancel_release(Segment* seg) {
  seg->releasing = false;
  free_segments_.insert(seg);
  for (Block* b = seg->first; b; b = b->next) {
    if (b->state == BState::kUnbacked) continue;
    b->state = BState::kFree;
    insert_free(b);
  }
}

void BlockPool::remove_segment(Segment* seg) {
  for (Block* b = seg->first; b;) {
    Block* n = b->next;
    delete b;
    b = n;
  }
  segments_.erase(seg);
  delete seg;
}

// ---- free sets, merging, segment accounting ---------------------------------------

void BlockPool::insert_free(Block* b) {
  Pool& p = pool(b->seg->small);
  (b->ready ? p.ready : p.owned[b->stream]).insert(b);
}

void BlockPool::erase_free(Block* b) {
  Pool& p = pool(b->seg->small);
  if (b->ready) {
    p.ready.erase(b);
    return;
  }
  auto it = p.owned.find(b->stream);
  it->second.erase(b);
  if (it->second.empty()) p.owned.erase(it);
}

bool BlockPool::mergeable(const Block* a, const Block* b) {
  return a->state == BState::kFree && b->state == BState::kFree && a->ready == b->ready &&
         (a->ready || a->stream == b->stream);
}

Block* BlockPool::merge_and_insert(Block* b) {
  if (Block* p = b->prev; p && mergeable(p, b)) {
    erase_free(p);
    p->size += b->size;
    p->free_seq = std::max(p->free_seq, b->free_seq);
    p->next = b->next;
    if (b->next) b->next->prev = p;
    delete b;
    b = p;
  }
  if (Block* n = b->next; n && mergeable(b, n)) {
    erase_free(n);
    b->size += n->size;
    b->free_seq = std::max(b->free_seq, n->free_seq);
    b->next = n->next;
    if (n->next) n->next->prev = b;
    delete n;
  }
  insert_free(b);
  return b;
}

void BlockPool::became_busy(Segment* s) {
  if (s->busy++ == 0) free_segments_.erase(s);
}

void BlockPool::became_idle(Segment* s) {
  if (--s->busy == 0 && !s->releasing) free_segments_.insert(s);
}

void BlockPool::make_free(Block* b, bool ready) {
  b->state = BState::kFree;
  b->ready = ready;
  b->captured = false;
  b->pending = 0;
  b->uses.clear();
  became_idle(b->seg);
  merge_and_insert(b);
}

void BlockPool::promote(StreamId s, uint64_t watermark) {
  for (Pool& p : pools_) {
    auto it = p.owned.find(s);
    if (it == p.owned.end()) continue;
    std::vector<Block*> done;
    for (Block* b : it->second) {
      if (b->free_seq <= watermark) done.push_back(b);
    }
    // Merging below only joins ready blocks, so no block of `done` is
    // deleted before its turn.
    for (Block* b : done) {
      erase_free(b);
      b->ready = true;
      merge_and_insert(b);
    }
  }
}

void BlockPool::unback(Block* b, uint64_t offset, uint64_t bytes) {
  erase_free(b);
  // Splits off [at, end) of `x` as a new block after it, alike in all else.
  auto split = [](Block* x, uint64_t at) {
    auto* r = new Block(*x);
    r->addr = x->addr + at;
    r->size = x->size - at;
    r->prev = x;
    r->next = x->next;
    if (x->next) x->next->prev = r;
    x->next = r;
    x->size = at;
    return r;
  };
  Block* mid = b;
  if (offset > 0) {
    mid = split(b, offset);
    insert_free(b);  // the head: its neighbours are not mergeable with it
  }
  if (mid->size > bytes) insert_free(split(mid, bytes));  // the tail
  mid->state = BState::kUnbacked;
  mid->ready = true;  // no stream's work is on it any more (the pages are gone)
  mid->uses.clear();
  mid->seg->unbacked += bytes;
}

// ---- placement ------------------------------------------------------------------

Block* BlockPool::best_fit(bool small, uint64_t size, StreamId stream, bool capturing) {
  Pool& p = pool(small);
  Block key;
  key.size = size;
  Block* best = nullptr;
  if (auto it = p.ready.lower_bound(&key); it != p.ready.end()) best = *it;
  // A capture takes only ready blocks: another stream's work may still be
  // queued on the others, and a replay can run on any stream.
  if (capturing) return best;
  if (auto o = p.owned.find(stream); o != p.owned.end()) {
    auto it = o->second.lower_bound(&key);
    // Ties go to the stream's own block: ready ones stay for other streams.
    if (it != o->second.end() && (!best || (*it)->size <= best->size)) best = *it;
  }
  return best;
}

void BlockPool::take(Block* b, uint64_t size, StreamId stream, bool capturing) {
  erase_free(b);
  b->state = BState::kLive;  // before the rest is split off: it must not merge back
  uint64_t rest = b->size - size;
  bool split = b->seg->small ? rest >= opt_.granularity : rest > opt_.small_limit;
  if (split) {
    auto* r = new Block;
    r->addr = b->addr + size;
    r->size = rest;
    r->seg = b->seg;
    r->prev = b;
    r->next = b->next;
    r->ready = b->ready;
    r->stream = b->stream;
    r->free_seq = b->free_seq;
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = size;
    merge_and_insert(r);
  }
  b->ready = false;
  b->stream = stream;
  b->captured = capturing;
  b->uses.clear();
  became_busy(b->seg);
}

// ---- what stream order asks -----------------------------------------------------

std::vector<StreamId> BlockPool::owners(bool small) const {
  std::vector<StreamId> out;
  for (const auto& [s, set] : pool(small).owned) out.push_back(s);
  return out;
}

std::vector<StreamId> BlockPool::owners_of(bool small, uint64_t size) const {
  std::vector<StreamId> out;
  for (const auto& [s, set] : pool(small).owned) {
    if (set.empty() || (*set.rbegin())->size < size) continue;
    out.push_back(s);
  }
  return out;
}

// ---- invariant checks -----------------------------------------------------------

bool BlockPool::in_free_set(const Block* b) const {
  const Pool& p = pool(b->seg->small);
  if (b->ready) return p.ready.count(const_cast<Block*>(b)) > 0;
  auto o = p.owned.find(b->stream);
  return o != p.owned.end() && o->second.count(const_cast<Block*>(b)) > 0;
}

BlockPool::FreeSetCount BlockPool::count_free_sets() const {
  FreeSetCount n;
  for (const Pool& p : pools_) {
    n.blocks += p.ready.size();
    for (const auto& [s, set] : p.owned) {
      if (set.empty()) ++n.empty_sets;
      n.blocks += set.size();
    }
  }
  return n;
}

}  // namespace leasehold::torch_plugin::detail
