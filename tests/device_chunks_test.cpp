// The device layer's chunks on the host backend, and the chunk socket that
// hands them out: what a process can reach is what it mapped.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <thread>

#include "shared/chunk_channel.h"
#include "shared/chunk_window.h"
#include "shared/device.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "shared/cuda_check.h"
#endif
#include "tests/support/faults.h"

namespace leasehold {
namespace {

using testing::faults;

constexpr uint64_t kChunk = 64 << 10;

std::vector<UniqueFd> shares(const DevicePool& pool, uint64_t first, uint64_t count, Access a) {
  std::vector<UniqueFd> fds;
  for (uint64_t i = first; i < first + count; ++i) fds.push_back(pool.share(i, a));
  return fds;
}

TEST(DeviceChunks, APoolIsWholeChunksEachItsOwnSealedMemory) {
  auto pool = create_pool(Backend::Host, 0, 10 * kChunk + 123, kChunk);
  EXPECT_EQ(pool->descriptor().size, 10 * kChunk) << "rounded down to whole chunks";
  EXPECT_EQ(pool->chunk_count(), 10u);
  EXPECT_EQ(pool->descriptor().chunk_count(), 10u);
  // Nobody handed a chunk can shrink it under the others' feet.
  UniqueFd fd = pool->share(3, Access::ReadWrite);
  EXPECT_NE(::ftruncate(fd.get(), 0), 0);
  EXPECT_THROW(create_pool(Backend::Host, 0, 10 * kChunk, 1000), std::invalid_argument)
      << "not whole pages";
  EXPECT_THROW(create_pool(Backend::Host, 0, kChunk / 2, kChunk), std::invalid_argument)
      << "less than a chunk";
}

TEST(DeviceChunks, OnlyMappedChunksAreReachableAndTwoMappingsShareTheMemory) {
  auto pool = create_pool(Backend::Host, 0, 8 * kChunk, kChunk);
  auto a = map_pool(pool->descriptor());
  auto b = map_pool(pool->descriptor());
  a->map(2, shares(*pool, 2, 2, Access::ReadWrite), Access::ReadWrite);
  b->map(3, shares(*pool, 3, 1, Access::ReadWrite), Access::ReadWrite);
  std::memset(a->base() + 2 * kChunk, 7, 2 * kChunk);
  EXPECT_EQ(static_cast<int>(b->base()[3 * kChunk + 17]), 7) << "the same physical chunk";
  EXPECT_TRUE(faults([&] { (void)*reinterpret_cast<volatile char*>(b->base() + 2 * kChunk); }))
      << "chunk 2 is not b's";
  EXPECT_TRUE(faults([&] { (void)*reinterpret_cast<volatile char*>(a->base()); }));
  a->unmap(2, 2, Access::ReadWrite);
  EXPECT_EQ(a->access(2), std::nullopt);
  EXPECT_TRUE(faults([&] { (void)*reinterpret_cast<volatile char*>(a->base() + 3 * kChunk); }))
      << "unmapped: out of reach again";
  EXPECT_EQ(static_cast<int>(b->base()[3 * kChunk]), 7) << "b keeps its chunk";
}

// A hostile holder keeps the memory of a chunk it gave back (a map of its
// own, here of the descriptor it was sent): once the chunk is renewed, the
// next holder's bytes are out of its reach, and its writes out of theirs.
TEST(DeviceChunks, ARenewedChunkIsNewMemoryAndWhatWasKeptOfTheOldReachesNothing) {
  auto pool = create_pool(Backend::Host, 0, 4 * kChunk, kChunk);
  UniqueFd kept_fd = pool->share(1, Access::ReadWrite);
  void* kept = ::mmap(nullptr, kChunk, PROT_READ | PROT_WRITE, MAP_SHARED, kept_fd.get(), 0);
  ASSERT_NE(kept, MAP_FAILED);
  std::memset(kept, 1, kChunk);
  pool->renew(1, 1);
  EXPECT_GE(pool->chunk_fd(1), 0);
  auto next = map_pool(pool->descriptor());
  next->map(1, shares(*pool, 1, 1, Access::ReadWrite), Access::ReadWrite);
  std::byte* mine = next->base() + kChunk;
  EXPECT_EQ(static_cast<int>(mine[5]), 0) << "new memory, not the old holder's bytes";
  std::memset(mine, 9, kChunk);
  EXPECT_EQ(static_cast<const char*>(kept)[5], 1) << "the kept map does not see the new holder";
  static_cast<char*>(kept)[6] = 3;
  EXPECT_EQ(static_cast<int>(mine[6]), 9) << "nor write into it";
  // Read-only shares are of the new memory too; the other chunks are as
  // they were.
  UniqueFd ro = pool->share(1, Access::ReadOnly);
  void* r = ::mmap(nullptr, kChunk, PROT_READ, MAP_SHARED, ro.get(), 0);
  ASSERT_NE(r, MAP_FAILED);
  EXPECT_EQ(static_cast<const char*>(r)[7], 9);
  EXPECT_THROW(pool->renew(3, 2), std::out_of_range);
  ::munmap(r, kChunk);
  ::munmap(kept, kChunk);
}

TEST(DeviceChunks, ReadOnlyMapsAndDescriptorsCannotWrite) {
  auto pool = create_pool(Backend::Host, 0, 4 * kChunk, kChunk);
  auto m = map_pool(pool->descriptor());
  m->map(1, shares(*pool, 1, 1, Access::ReadOnly), Access::ReadOnly);
  EXPECT_EQ(m->access(1), Access::ReadOnly);
  EXPECT_EQ(static_cast<int>(m->base()[kChunk]), 0);
  EXPECT_TRUE(faults([&] { *reinterpret_cast<volatile char*>(m->base() + kChunk) = 1; }));
  // The descriptor itself refuses a writable mapping.
  UniqueFd ro = pool->share(1, Access::ReadOnly);
  EXPECT_EQ(::mmap(nullptr, kChunk, PROT_READ | PROT_WRITE, MAP_SHARED, ro.get(), 0), MAP_FAILED);
  EXPECT_EQ(errno, EACCES);
  EXPECT_NE(::mprotect(m->base() + kChunk, kChunk, PROT_READ | PROT_WRITE), 0)
      << "nor can the mapping be widened in place";
  if (::geteuid() != 0) {  // root passes file modes
    const std::string again = "/proc/self/fd/" + std::to_string(ro.get());
    EXPECT_EQ(::open(again.c_str(), O_RDWR), -1) << "nor opened again for writing";
  }
}

TEST(DeviceChunks, MapsAreCountedPerAccessAndNarrowed) {
  auto pool = create_pool(Backend::Host, 0, 4 * kChunk, kChunk);
  auto m = map_pool(pool->descriptor());
  m->map(0, shares(*pool, 0, 1, Access::ReadOnly), Access::ReadOnly);
  m->map(0, shares(*pool, 0, 1, Access::ReadWrite), Access::ReadWrite);
  EXPECT_EQ(m->access(0), Access::ReadWrite) << "writable while any map writes";
  m->base()[5] = std::byte{9};
  m->unmap(0, 1, Access::ReadWrite);
  EXPECT_EQ(m->access(0), Access::ReadOnly);
  EXPECT_TRUE(faults([&] { *reinterpret_cast<volatile char*>(m->base()) = 1; }));
  EXPECT_EQ(static_cast<int>(m->base()[5]), 9);
  m->map(1, shares(*pool, 1, 1, Access::ReadWrite), Access::ReadWrite);
  m->narrow(1, 1);
  EXPECT_EQ(m->access(1), Access::ReadOnly);
  EXPECT_TRUE(faults([&] { *reinterpret_cast<volatile char*>(m->base() + kChunk) = 1; }));
  m->unmap(0, 2, Access::ReadOnly);
  EXPECT_EQ(m->access(0), std::nullopt);
  EXPECT_EQ(m->access(1), std::nullopt);
  // Undoing a map that was never made changes nothing.
  m->unmap(2, 1, Access::ReadWrite);
  EXPECT_EQ(m->access(2), std::nullopt);
  std::vector<UniqueFd> two = shares(*pool, 2, 2, Access::ReadWrite);
  EXPECT_THROW(m->map(3, std::move(two), Access::ReadWrite), std::out_of_range) << "past the end";
  EXPECT_EQ(m->access(3), std::nullopt);
  EXPECT_THROW(pool->share(4, Access::ReadWrite), std::out_of_range);
}

// A chunk server on a thread of its own, deciding with `decide`.
class ServedPool {
 public:
  explicit ServedPool(ChunkServer::Decide decide, uint64_t chunks = 300, uint64_t chunk = kChunk)
      : dir_(std::filesystem::temp_directory_path() / ("lh-chunks-" + std::to_string(::getpid()))),
        pool_(create_pool(Backend::Host, 0, chunks * chunk, chunk)) {
    std::filesystem::create_directories(dir_);
    server_ = std::make_unique<ChunkServer>((dir_ / "c.sock").string(), nullptr,
                                            [this, decide](const ChunkRequest& r, pid_t p, uid_t u) {
                                              auto d = decide(r, p, u);
                                              if (d.grant) d.pool = pool_.get();
                                              return d;
                                            });
    thread_ = std::thread([this] {
      while (!stop_) {
        std::vector<pollfd> fds{{server_->listen_fd(), POLLIN, 0}};
        for (int fd : server_->connections()) fds.push_back({fd, POLLIN, 0});
        ::poll(fds.data(), fds.size(), 20);
        if (fds[0].revents) server_->accept_pending();
        for (size_t i = 1; i < fds.size(); ++i) {
          if (fds[i].revents) server_->serve(fds[i].fd);
        }
      }
    });
  }
  ~ServedPool() {
    stop_ = true;
    thread_.join();
    server_.reset();
    std::filesystem::remove_all(dir_);
  }
  std::string path() const { return server_->path(); }
  const DevicePool& pool() const { return *pool_; }

 private:
  std::filesystem::path dir_;
  std::unique_ptr<DevicePool> pool_;
  std::unique_ptr<ChunkServer> server_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// The permissions /proc/self/maps gives the page at `p` ("rw-s", "---p");
// empty when nothing is mapped there. (A forked child cannot tell: chunks
// and window pages are not inherited by children at all.)
std::string perms_at(const void* p) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto at = reinterpret_cast<uintptr_t>(p);
  while (std::getline(maps, line)) {
    uintptr_t lo = 0, hi = 0;
    char perms[5] = {};
    if (std::sscanf(line.c_str(), "%lx-%lx %4s", &lo, &hi, perms) == 3 && lo <= at && at < hi) {
      return perms;
    }
  }
  return "";
}

TEST(ChunkWindows, AWindowShowsHeldChunksAtAnyPageAndTheMemoryIsTheSame) {
  auto pool = create_pool(Backend::Host, 0, 8 * kChunk, kChunk);
  std::shared_ptr<PoolMapping> m = map_pool(pool->descriptor());
  m->map(2, shares(*pool, 2, 4, Access::ReadWrite), Access::ReadWrite);
  auto w = open_window(m, 6);
  EXPECT_EQ(w->page_count(), 6u);
  EXPECT_EQ(w->page_size(), kChunk);
  EXPECT_EQ(perms_at(w->base()), "---p") << "a new window shows nothing";
  w->show(4, {3, 2});  // two chunks that are far apart in the pool, side by side
  EXPECT_EQ(w->shown(4), 3u);
  EXPECT_EQ(w->shown(5), 2u);
  EXPECT_EQ(w->shown(0), std::nullopt);
  EXPECT_EQ(w->shown_count(), 2u);
  std::memset(w->base() + 4 * kChunk, 0x11, 2 * kChunk);  // one write across both pages
  EXPECT_EQ(static_cast<int>(m->base()[3 * kChunk + 5]), 0x11) << "page 4 is chunk 3";
  EXPECT_EQ(static_cast<int>(m->base()[2 * kChunk + kChunk - 1]), 0x11) << "page 5 is chunk 2";
  m->base()[2 * kChunk] = std::byte{0x22};
  EXPECT_EQ(static_cast<int>(w->base()[5 * kChunk]), 0x22);
  w->hide(4, 1);
  EXPECT_EQ(perms_at(w->base() + 4 * kChunk), "---p") << "a hidden page shows nothing";
  EXPECT_EQ(perms_at(w->base() + 5 * kChunk).substr(0, 2), "rw");
  EXPECT_EQ(static_cast<int>(m->base()[3 * kChunk + 5]), 0x11) << "hiding keeps the memory";
  w->show(0, {3});  // a chunk hidden in one place backs another
  EXPECT_EQ(static_cast<int>(w->base()[5]), 0x11);
  w->hide(0, 6);
  EXPECT_EQ(w->shown_count(), 0u);
  EXPECT_EQ(perms_at(w->base() + 5 * kChunk), "---p");
}

TEST(ChunkWindows, OnlyChunksThisProcessMayWriteAreShownAndBadPagesAreRefused) {
  auto pool = create_pool(Backend::Host, 0, 8 * kChunk, kChunk);
  std::shared_ptr<PoolMapping> m = map_pool(pool->descriptor());
  m->map(1, shares(*pool, 1, 1, Access::ReadWrite), Access::ReadWrite);
  m->map(2, shares(*pool, 2, 1, Access::ReadOnly), Access::ReadOnly);
  auto w = open_window(m, 4);
  EXPECT_THROW(w->show(0, {2}), std::logic_error) << "a read-only region's chunk";
  EXPECT_THROW(w->show(0, {5}), std::logic_error) << "a chunk not mapped here";
  EXPECT_THROW(w->show(0, {8}), std::out_of_range) << "past the pool";
  EXPECT_THROW(w->show(4, {1}), std::out_of_range) << "past the window";
  EXPECT_THROW(w->show(3, {1, 1}), std::out_of_range) << "a run past the window";
  EXPECT_THROW(w->show(UINT64_MAX, {1}), std::out_of_range);
  EXPECT_EQ(w->shown_count(), 0u) << "nothing of a refused call stays";
  w->show(1, {1});
  EXPECT_THROW(w->show(0, {1, 1}), std::logic_error) << "page 1 shows a chunk already";
  EXPECT_EQ(w->shown(0), std::nullopt) << "all or nothing";
  EXPECT_THROW(open_window(m, 0), std::invalid_argument);
  EXPECT_THROW(open_window(nullptr, 4), std::invalid_argument);
  w->hide(0, 100);  // pages past the window and pages showing nothing are skipped
  EXPECT_EQ(w->shown_count(), 0u);
}

TEST(ChunkChannel, AGrantComesInBatchesAndAskingAgainFromAChunkOnGetsTheRest) {
  ServedPool served([](const ChunkRequest& r, pid_t pid, uid_t) {
    ChunkServer::Decision d;
    if (r.agent == "a" && pid == ::getpid()) d.grant = ChunkGrant{0, 10, 290, Access::ReadWrite};
    else d.refusal = "not yours";
    return d;
  });
  ChunkClient client(served.path());
  ChunkRequest req;
  req.agent = "a";
  req.lease_id = 1;
  uint64_t got = 0, batches = 0, next = 10;
  ChunkGrant g = client.fetch(req, [&](uint64_t first, std::vector<UniqueFd> fds, const ChunkGrant&) {
    EXPECT_EQ(first, next);
    next += fds.size();
    got += fds.size();
    ++batches;
  });
  EXPECT_EQ(g.first, 10u);
  EXPECT_EQ(g.count, 290u);
  EXPECT_EQ(got, 290u);
  EXPECT_EQ(batches, (290 + kChunkBatch - 1) / kChunkBatch);
  req.from_chunk = 250;
  got = 0;
  client.fetch(req, [&](uint64_t first, std::vector<UniqueFd> fds, const ChunkGrant&) {
    EXPECT_EQ(first, 250u);
    got += fds.size();
  });
  EXPECT_EQ(got, 50u);
  req.agent = "b";
  try {
    client.fetch(req, [](uint64_t, std::vector<UniqueFd>, const ChunkGrant&) {});
    FAIL() << "b got a's chunks";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "not yours");
  }
}

// More chunks than one answer carries: the client asks again from where the
// answer stopped, and nothing is dropped for not keeping up.
TEST(ChunkChannel, AGrantLargerThanOneAnswerComesInSeveral) {
  const uint64_t chunks = kAnswerChunks + 904;
  ServedPool served(
      [&](const ChunkRequest&, pid_t, uid_t) {
        ChunkServer::Decision d;
        d.grant = ChunkGrant{0, 0, chunks, Access::ReadWrite};
        return d;
      },
      chunks, 4096);
  ChunkClient client(served.path());
  ChunkRequest req;
  req.agent = "a";
  uint64_t got = 0, next = 0;
  client.fetch(req, [&](uint64_t first, std::vector<UniqueFd> fds, const ChunkGrant&) {
    EXPECT_EQ(first, next);
    next += fds.size();
    got += fds.size();
    std::this_thread::sleep_for(std::chrono::microseconds(200));  // an asker that maps as it goes
  });
  EXPECT_EQ(got, chunks);
}

TEST(ChunkChannel, MalformedRequestsAreRefusedAndTheServerKeepsServing) {
  ServedPool served([](const ChunkRequest&, pid_t, uid_t) {
    ChunkServer::Decision d;
    d.grant = ChunkGrant{0, 0, 1, Access::ReadOnly};
    return d;
  });
  for (size_t size : {size_t{0}, size_t{1}, size_t{64}, size_t{4096}}) {
    UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, served.path().c_str(), sizeof addr.sun_path - 1);
    ASSERT_EQ(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    std::vector<char> junk(size, '\x7f');
    ::send(fd.get(), junk.data(), junk.size(), MSG_NOSIGNAL);
    char answer[1024];
    timeval tv{5, 0};
    ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const ssize_t n = ::recv(fd.get(), answer, sizeof answer, 0);
    if (size > 0) {
      EXPECT_GT(n, 0) << "a refusal for " << size << " bytes";
    }
  }
  ChunkClient client(served.path());
  ChunkRequest req;
  req.agent = "a";
  uint64_t got = 0;
  client.fetch(req, [&](uint64_t, std::vector<UniqueFd> fds, const ChunkGrant&) { got += fds.size(); });
  EXPECT_EQ(got, 1u) << "still serving";
}

#ifdef LEASEHOLD_HAVE_CUDA
// The same on CUDA: a holder that kept its import of a chunk (its mapping
// stays) reaches only the old memory once the chunk is renewed.
TEST(DeviceChunks, ARenewedCudaChunkIsNewMemoryAndAKeptImportReachesNothing) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device visible: test skipped";
  const uint64_t chunk = chunk_granularity(Backend::Cuda, 0);
  auto pool = create_pool(Backend::Cuda, 0, 4 * chunk, chunk);
  auto kept = map_pool(pool->descriptor());
  kept->map(1, shares(*pool, 1, 1, Access::ReadWrite), Access::ReadWrite);
  void* old_mem = kept->base() + chunk;
  LEASEHOLD_CUDA_CHECK(cudaMemset(old_mem, 0x11, chunk));
  LEASEHOLD_CUDA_CHECK(cudaDeviceSynchronize());
  pool->renew(1, 1);
  auto next = map_pool(pool->descriptor());
  next->map(1, shares(*pool, 1, 1, Access::ReadWrite), Access::ReadWrite);
  void* new_mem = next->base() + chunk;
  LEASEHOLD_CUDA_CHECK(cudaMemset(new_mem, 0x22, chunk));
  LEASEHOLD_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<unsigned char> a(chunk), b(chunk);
  LEASEHOLD_CUDA_CHECK(cudaMemcpy(a.data(), old_mem, chunk, cudaMemcpyDeviceToHost));
  LEASEHOLD_CUDA_CHECK(cudaMemcpy(b.data(), new_mem, chunk, cudaMemcpyDeviceToHost));
  EXPECT_EQ(std::count(a.begin(), a.end(), 0x11), static_cast<std::ptrdiff_t>(chunk))
      << "the kept import sees none of the new holder's writes";
  EXPECT_EQ(std::count(b.begin(), b.end(), 0x22), static_cast<std::ptrdiff_t>(chunk));
  kept->unmap(1, 1, Access::ReadWrite);
  next->unmap(1, 1, Access::ReadWrite);
}
#endif

}  // namespace
}  // namespace leasehold
