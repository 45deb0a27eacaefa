// PoolHold: what a Lease or a RegionAttachment holds of its session, and
// the chunks of the pool it has mapped (lease_client/session.h).
#include <stdexcept>
#include <utility>

#include "lease_client/session.h"
#include "lease_client/session_core.h"

namespace leasehold {

namespace detail {

PoolHold::PoolHold(std::shared_ptr<SessionCore> c, std::shared_ptr<PoolMapping> m, uint64_t e)
    : core(std::move(c)), mapping(std::move(m)), epoch(e) {
  std::lock_guard lock(core->mu);
  ++core->holds[epoch];
}

PoolHold& PoolHold::operator=(PoolHold&& o) noexcept {
  if (this != &o) {
    clear();
    core = std::move(o.core);
    mapping = std::move(o.mapping);
    epoch = o.epoch;
    first_chunk = o.first_chunk;
    chunk_count = std::exchange(o.chunk_count, 0);
    access = o.access;
    o.core.reset();
    o.mapping.reset();
  }
  return *this;
}

void PoolHold::map(ChunkRequest req, uint64_t first, uint64_t count, ErrorCode code,
                   const std::string& what) {
  std::shared_ptr<ChunkClient> client;
  {
    std::lock_guard lock(core->mu);
    if (!core->connected || core->epoch != epoch) {
      throw Error(code, "cannot map " + what + ": it was lost with the coordinator session");
    }
    client = core->chunks;
    req.session = core->session;
  }
  req.agent = core->opts.name;
  if (chunk_count == 0) first_chunk = first;
  if (chunk_count > 0 && first == first_chunk && chunk_count == count) return;  // all mapped
  req.from_chunk = first_chunk + chunk_count;
  const uint64_t mapped_before = chunk_count;
  try {
    if (!client) throw std::runtime_error("no chunk socket (not registered)");
    if (first != first_chunk) throw std::runtime_error("a grant that moved");
    const ChunkGrant grant =
        client->fetch(req, [&](uint64_t at, std::vector<UniqueFd> fds, const ChunkGrant& g) {
          if (g.first != first || g.count != count || at != first_chunk + chunk_count) {
            throw std::runtime_error("the coordinator sent chunks " + std::to_string(g.first) +
                                     "+" + std::to_string(g.count) + ", not " +
                                     std::to_string(first) + "+" + std::to_string(count));
          }
          if (chunk_count > mapped_before && g.access != access) {
            throw std::runtime_error("the coordinator changed the access mid-answer");
          }
          access = g.access;
          const uint64_t n = fds.size();
          mapping->map(at, std::move(fds), g.access);
          chunk_count += n;
        });
    if (grant.first != first || grant.count != count || first_chunk + chunk_count != first + count) {
      throw std::runtime_error("the coordinator granted chunks " + std::to_string(grant.first) +
                               "+" + std::to_string(grant.count) + ", not " +
                               std::to_string(first) + "+" + std::to_string(count));
    }
  } catch (const std::exception& e) {
    unmap(mapped_before);
    throw Error(code, "cannot map " + what + ": " + e.what());
  }
}

void PoolHold::narrow() noexcept {
  if (!mapping || chunk_count == 0 || access == Access::ReadOnly) return;
  mapping->narrow(first_chunk, chunk_count);
  access = Access::ReadOnly;
}

void PoolHold::unmap(uint64_t keep) noexcept {
  if (!mapping || chunk_count <= keep) return;
  mapping->unmap(first_chunk + keep, chunk_count - keep, access);
  chunk_count = keep;
}

void PoolHold::clear() noexcept {
  unmap();
  if (!core) return;
  {
    std::lock_guard lock(core->mu);
    auto it = core->holds.find(epoch);
    if (it != core->holds.end() && --it->second == 0) core->holds.erase(it);
  }
  core.reset();
  mapping.reset();
}

bool PoolHold::lost() const {
  if (!core) return false;
  std::lock_guard lock(core->mu);
  return !core->connected || core->epoch != epoch;
}

Backend PoolHold::backend() const { return mapping ? mapping->descriptor().backend : Backend::Host; }

int PoolHold::device() const { return mapping ? mapping->descriptor().device : 0; }

std::byte* PoolHold::at(uint64_t offset, ErrorCode code, const std::string& what) const {
  if (!core) throw Error(code, what + " is not held");
  if (lost()) throw Error(code, what + " was lost with the coordinator session");
  return mapping->base() + offset;
}

}  // namespace detail

}  // namespace leasehold
