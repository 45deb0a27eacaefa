#include "shared/chunk_window.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "shared/detail/backends.h"
#include "shared/device.h"

namespace leasehold {

ChunkWindow::ChunkWindow(std::shared_ptr<PoolMapping> source, std::byte* base, uint64_t pages,
                         uint64_t page_size)
    : source_(std::move(source)),
      base_(base),
      page_count_(pages),
      page_size_(page_size),
      shown_(pages, 0) {}

void ChunkWindow::show(uint64_t first, const std::vector<uint64_t>& chunks) {
  if (first > page_count_ || chunks.size() > page_count_ - first) {
    throw std::out_of_range("pages " + std::to_string(first) + "+" + std::to_string(chunks.size()) +
                            " are outside a window of " + std::to_string(page_count_));
  }
  const uint64_t pool_chunks = source_->descriptor().chunk_count();
  std::vector<std::byte*> sources;
  sources.reserve(chunks.size());
  for (uint64_t c : chunks) {
    if (c >= pool_chunks) {
      throw std::out_of_range("chunk " + std::to_string(c) + " is outside the pool's " +
                              std::to_string(pool_chunks));
    }
    if (source_->access(c) != Access::ReadWrite) {
      throw std::logic_error("chunk " + std::to_string(c) +
                             " is not mapped read-write in this process: only a held lease's "
                             "chunks may be shown");
    }
    sources.push_back(source_->base() + c * page_size_);
  }
  std::lock_guard lock(mu_);
  for (uint64_t k = 0; k < chunks.size(); ++k) {
    if (shown_[first + k] != 0) {
      throw std::logic_error("page " + std::to_string(first + k) + " shows chunk " +
                             std::to_string(shown_[first + k] - 1) + " already");
    }
  }
  if (chunks.empty()) return;
  show_pages(first, sources);
  for (uint64_t k = 0; k < chunks.size(); ++k) shown_[first + k] = chunks[k] + 1;
}

bool ChunkWindow::hide(uint64_t first, uint64_t count) noexcept {
  std::lock_guard lock(mu_);
  uint64_t run_first = 0, run = 0;
  bool ok = true;
  auto flush = [&] {
    if (!run) return;
    const std::vector<uint64_t> stuck = hide_pages(run_first, run);
    for (uint64_t p = run_first; p < run_first + run; ++p) {
      if (std::find(stuck.begin(), stuck.end(), p) == stuck.end()) shown_[p] = 0;
    }
    ok = ok && stuck.empty();
    run = 0;
  };
  for (uint64_t p = first; p < first + count && p < page_count_; ++p) {
    if (shown_[p] == 0) {
      flush();
      continue;
    }
    if (run == 0) run_first = p;
    ++run;
  }
  flush();
  return ok;
}

void ChunkWindow::hide_all() noexcept { hide(0, page_count_); }

std::optional<uint64_t> ChunkWindow::shown(uint64_t page) const {
  std::lock_guard lock(mu_);
  if (page >= page_count_ || shown_[page] == 0) return std::nullopt;
  return shown_[page] - 1;
}

uint64_t ChunkWindow::shown_count() const {
  std::lock_guard lock(mu_);
  uint64_t n = 0;
  for (uint64_t s : shown_) n += s != 0;
  return n;
}

std::unique_ptr<ChunkWindow> open_window(std::shared_ptr<PoolMapping> source, uint64_t pages) {
  if (!source) throw std::invalid_argument("a window needs a pool mapping");
  if (pages == 0) throw std::invalid_argument("a window of 0 pages");
  if (source->descriptor().backend == Backend::Host) {
    return detail::open_host_window(std::move(source), pages);
  }
#ifdef LEASEHOLD_HAVE_CUDA
  return detail::open_cuda_window(std::move(source), pages);
#else
  throw std::runtime_error("cannot open a window on a CUDA pool: this build has no CUDA support");
#endif
}

}  // namespace leasehold
