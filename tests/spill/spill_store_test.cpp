// The spill stores on the host backend against real files in a temporary
// directory: round trips through every tier, planned host tensors sharing
// the host tier, reads served from staging while a write is held back (a
// transfer whose fences the test opens), prefetch, extent reuse and a
// bounded file. One test runs the tiered store over CUDA memory and is
// skipped where no GPU is visible. (Faults and limits:
// spill_store_faults_test.cpp.)
#include <gtest/gtest.h>

#include "tests/spill/spill_test_support.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "agent/engine/cuda_context.h"
#endif

namespace leasehold::spill {
namespace {

using namespace test;  // NOLINT(google-build-using-namespace): the tests' shared helpers

TEST_F(SpillTest, MemoryStoreRoundTripsOddSizes) {
  MemorySpillStore store(*transfer_);
  std::vector<std::vector<char>> data;
  for (size_t i = 0; i < kOddSizes.size(); ++i) {
    data.push_back(random_bytes(kOddSizes[i], static_cast<uint32_t>(i)));
    std::vector<char> src = data[i];
    ASSERT_TRUE(store.put(i, src.data(), src.size(), "t" + std::to_string(i)).ok());
    EXPECT_TRUE(store.copied(i));
    EXPECT_TRUE(store.wait_copied(i).ok());
    // The store holds its own copy: the source may change once copied.
    std::fill(src.begin(), src.end(), 0);
  }
  for (size_t i = 0; i < kOddSizes.size(); ++i) expect_round_trip(store, i, data[i]);
  SpillStats s = store.stats();
  EXPECT_EQ(s.host_bytes, sum(kOddSizes));
  EXPECT_EQ(s.peak_host_bytes, sum(kOddSizes));
  EXPECT_EQ(s.file_bytes, 0u);
  EXPECT_EQ(s.bytes_out, sum(kOddSizes));
  EXPECT_EQ(s.bytes_in, sum(kOddSizes));
  for (size_t i = 0; i < kOddSizes.size(); ++i) store.erase(i);
  EXPECT_EQ(store.stats().host_bytes, 0u);
  Status st = store.get(0, data[0].data());
  EXPECT_TRUE(st.is_not_found()) << st.to_string();
}

TEST_F(SpillTest, MemoryStoreLimitGivesEnospc) {
  MemorySpillStore store(*transfer_, 10000);
  auto a = random_bytes(6000, 1), b = random_bytes(6000, 2);
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());
  Status st = store.put(2, b.data(), b.size(), "layer2.weight");
  ASSERT_TRUE(st.is_io_error()) << st.to_string();
  EXPECT_EQ(st.error_number(), ENOSPC);
  EXPECT_NE(st.message().find("layer2.weight"), std::string::npos) << st.message();
  EXPECT_TRUE(store.get(2, b.data()).is_not_found());
  store.erase(1);
  EXPECT_TRUE(store.put(2, b.data(), b.size(), "layer2.weight").ok());
  expect_round_trip(store, 2, b);
}

TEST_F(SpillTest, HostTierOnlyRoundTripsOddSizes) {
  host_ = PinnedBuffer(1 << 20, Device::cpu());
  TieredStoreOptions o;
  o.host_tier = &host_;
  TieredSpillStore store(*transfer_, o);
  std::vector<std::vector<char>> data;
  for (size_t i = 0; i < kOddSizes.size(); ++i) {
    data.push_back(random_bytes(kOddSizes[i], static_cast<uint32_t>(10 + i)));
    Status st = store.put(i, data[i].data(), data[i].size(), "h" + std::to_string(i));
    ASSERT_TRUE(st.ok()) << st.to_string();
    EXPECT_TRUE(store.copied(i));
  }
  for (size_t i = 0; i < kOddSizes.size(); ++i) expect_round_trip(store, i, data[i]);
  SpillStats s = store.stats();
  EXPECT_EQ(s.host_bytes, sum(kOddSizes));
  EXPECT_EQ(s.file_bytes, 0u);
  EXPECT_EQ(s.file_bytes_written, 0u);
  EXPECT_EQ(s.bytes_in, sum(kOddSizes));
  EXPECT_TRUE(store.file_path().empty());
  EXPECT_TRUE(fs::is_empty(dir_));
  for (size_t i = 0; i < kOddSizes.size(); ++i) store.erase(i);
  EXPECT_EQ(store.stats().host_bytes, 0u);
  EXPECT_EQ(store.stats().peak_host_bytes, sum(kOddSizes));
}

TEST_F(SpillTest, HostTierFullWithoutFileTierGivesEnospc) {
  host_ = PinnedBuffer(64 << 10, Device::cpu());
  TieredStoreOptions o;
  o.host_tier = &host_;
  o.host_limit = 8192;  // of the 64 KiB buffer
  TieredSpillStore store(*transfer_, o);
  auto a = random_bytes(8000, 3), b = random_bytes(100, 4);
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());
  Status st = store.put(2, b.data(), b.size(), "fc1.bias");
  ASSERT_TRUE(st.is_io_error()) << st.to_string();
  EXPECT_EQ(st.error_number(), ENOSPC);
  EXPECT_NE(st.message().find("no room to spill tensor fc1.bias (100 bytes)"), std::string::npos)
      << st.message();
  EXPECT_NE(st.message().find("host tier"), std::string::npos) << st.message();
  expect_round_trip(store, 1, a);
  store.erase(1);
  ASSERT_TRUE(store.put(2, b.data(), b.size(), "fc1.bias").ok());
  expect_round_trip(store, 2, b);
}

TEST_F(SpillTest, FileTierOnlyRoundTripsOddSizes) {
  TieredSpillStore store(*transfer_, file_options());
  std::vector<std::vector<char>> data;
  for (size_t i = 0; i < kOddSizes.size(); ++i) {
    data.push_back(random_bytes(kOddSizes[i], static_cast<uint32_t>(20 + i)));
    Status st = store.put(i, data[i].data(), data[i].size(), "f" + std::to_string(i));
    ASSERT_TRUE(st.ok()) << st.to_string();
    ASSERT_TRUE(store.wait_copied(i).ok());
    EXPECT_TRUE(store.copied(i));
  }
  EXPECT_EQ(store.file_path(), spill_name(::getpid(), "t"));
  EXPECT_TRUE(fs::exists(store.file_path()));
  // Gets while writes may still be in flight (from staging or the file)...
  for (size_t i = 0; i < kOddSizes.size(); ++i) expect_round_trip(store, i, data[i]);
  // ...and after every write finished: each chunk comes from the file.
  ASSERT_TRUE(store.flush().ok());
  SpillStats before = store.stats();
  for (size_t i = 0; i < kOddSizes.size(); ++i) expect_round_trip(store, i, data[i]);
  SpillStats s = store.stats();
  EXPECT_EQ(s.staging_hits, before.staging_hits);
  // 1, 4095, 4097 and 3.5 chunks, each chunk padded to whole pages.
  const uint64_t padded = 4096 + 4096 + 8192 + 7 * kChunk / 2;
  EXPECT_EQ(s.file_bytes_written, padded);
  EXPECT_EQ(s.file_bytes_read - before.file_bytes_read, padded);
  EXPECT_EQ(s.file_bytes, sum(kOddSizes));
  EXPECT_EQ(s.host_bytes, 0u);
  EXPECT_EQ(s.bytes_out, sum(kOddSizes));
  EXPECT_EQ(s.bytes_in, 2 * sum(kOddSizes));
  EXPECT_GT(s.file_busy_seconds, 0.0);
  for (size_t i = 0; i < kOddSizes.size(); ++i) store.erase(i);
  EXPECT_EQ(store.stats().file_bytes, 0u);
  EXPECT_EQ(store.stats().peak_file_bytes, sum(kOddSizes));
}

// Without O_DIRECT (what the store falls back to where the file system
// refuses it): the same chunks, padding and checksums through the page cache.
TEST_F(SpillTest, BufferedFileTierRoundTrips) {
  TieredStoreOptions o = file_options(2);
  o.direct_io = false;
  TieredSpillStore store(*transfer_, o);
  std::vector<std::vector<char>> data;
  for (size_t i = 0; i < kOddSizes.size(); ++i) {
    data.push_back(random_bytes(kOddSizes[i], static_cast<uint32_t>(50 + i)));
    ASSERT_TRUE(store.put(i, data[i].data(), data[i].size(), "b").ok());
  }
  ASSERT_TRUE(store.flush().ok());
  for (size_t i = 0; i < kOddSizes.size(); ++i) expect_round_trip(store, i, data[i]);
  EXPECT_EQ(store.stats().file_bytes_read, 4096 + 4096 + 8192 + 7 * kChunk / 2);
}

TEST_F(SpillTest, TensorThatDoesNotFitTheHostTierGoesToTheFile) {
  host_ = PinnedBuffer(8192, Device::cpu());
  TieredStoreOptions o = file_options();
  o.host_tier = &host_;
  TieredSpillStore store(*transfer_, o);
  auto a = random_bytes(4097, 5);        // takes the whole host tier (two pages)
  auto b = random_bytes(4095, 6);        // one page: no room left there
  auto c = random_bytes(3 * kChunk, 7);  // larger than the host tier: never split
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());
  EXPECT_TRUE(store.file_path().empty());
  ASSERT_TRUE(store.put(2, b.data(), b.size(), "b").ok());
  ASSERT_TRUE(store.put(3, c.data(), c.size(), "c").ok());
  EXPECT_FALSE(store.file_path().empty());
  SpillStats s = store.stats();
  EXPECT_EQ(s.host_bytes, a.size());
  EXPECT_EQ(s.file_bytes, b.size() + c.size());
  expect_round_trip(store, 1, a);
  expect_round_trip(store, 2, b);
  expect_round_trip(store, 3, c);
  // Freed host room is used again.
  store.erase(1);
  auto d = random_bytes(5000, 8);
  ASSERT_TRUE(store.put(4, d.data(), d.size(), "d").ok());
  EXPECT_EQ(store.stats().host_bytes, d.size());
  expect_round_trip(store, 4, d);
}

// The job's page-locked tensors kept in host memory by plan come out of
// the same host tier as its spills, within its limit: a tensor there makes
// a spill that would have fit go to the file, one past the tier's room is
// refused naming the tier (the spilled tensor untouched), and freeing it
// gives the room back.
TEST_F(SpillTest, PlannedHostTensorsShareTheHostTier) {
  host_ = PinnedBuffer(64 << 10, Device::cpu());
  TieredStoreOptions o = file_options();
  o.host_tier = &host_;
  o.host_limit = 16 << 10;  // four pages of the 64 KiB buffer
  TieredSpillStore store(*transfer_, o);
  std::shared_ptr<engine::Allocator> tier = store.host_allocator();
  ASSERT_NE(tier, nullptr);
  EXPECT_EQ(tier->device(), Device::cpu());

  auto a = random_bytes(4096, 11);
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());  // one page of the four
  void* planned = tier->allocate(8192);                     // two more
  const auto* base = host_.data();
  ASSERT_GE(static_cast<const char*>(planned), base);
  ASSERT_LE(static_cast<const char*>(planned) + 8192, base + host_.size());
  EXPECT_EQ(reinterpret_cast<uintptr_t>(planned) % 256, 0u);
  std::memset(planned, 0x5a, 8192);
  EXPECT_EQ(tier->stats().in_use_bytes, 8192u);
  auto b = random_bytes(8192, 12);  // would have fit beside a alone
  ASSERT_TRUE(store.put(2, b.data(), b.size(), "b").ok());
  EXPECT_EQ(store.stats().host_bytes, a.size());
  EXPECT_EQ(store.stats().file_bytes, b.size());
  try {
    tier->allocate(8192);
    ADD_FAILURE() << "an allocation past the host tier's limit succeeded";
  } catch (const engine::OutOfMemoryError& e) {
    EXPECT_NE(std::string(e.what()).find("host tier"), std::string::npos) << e.what();
    EXPECT_EQ(e.requested(), 8192u);
  }
  expect_round_trip(store, 1, a);
  expect_round_trip(store, 2, b);
  for (size_t i = 0; i < 8192; ++i) {
    ASSERT_EQ(static_cast<const unsigned char*>(planned)[i], 0x5a) << "byte " << i;
  }
  tier->deallocate(planned, 8192);
  EXPECT_EQ(tier->stats().in_use_bytes, 0u);
  auto c = random_bytes(12288, 13);  // three pages: the room given back
  ASSERT_TRUE(store.put(3, c.data(), c.size(), "c").ok());
  EXPECT_EQ(store.stats().host_bytes, a.size() + c.size());
  expect_round_trip(store, 3, c);
}

TEST_F(SpillTest, AStoreWithoutAHostTierHasNoPlannedHostMemory) {
  TieredSpillStore no_tier(*transfer_, file_options());
  EXPECT_EQ(no_tier.host_allocator(), nullptr);
}

// A spill's range freed while its copy off the device is still queued: a
// spill takes it at once (its copy queues behind that one on the same copy
// stream), a planned tensor, written from the host or another stream, only
// once the copy is done.
TEST_F(SpillTest, APlannedTensorWaitsForASpillsCopyIntoItsRange) {
  host_ = PinnedBuffer(16 << 10, Device::cpu());
  GatedTransfer gated;
  TieredStoreOptions o;
  o.host_tier = &host_;
  TieredSpillStore store(gated, o);
  std::shared_ptr<engine::Allocator> tier = store.host_allocator();
  ASSERT_NE(tier, nullptr);
  auto a = random_bytes(4096, 21), b = random_bytes(4096, 22);
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());
  store.erase(1);  // its copy not done: the gate is shut
  ASSERT_TRUE(store.put(2, b.data(), b.size(), "b").ok());  // a spill does not wait
  std::atomic<bool> allocated{false};
  void* planned = nullptr;
  std::thread t([&] {
    planned = tier->allocate(4096);
    allocated = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(allocated) << "a planned tensor took a range a spill's copy may still write";
  gated.gate.open();
  t.join();
  ASSERT_TRUE(allocated);
  ASSERT_NE(planned, nullptr);
  tier->deallocate(planned, 4096);
  store.erase(2);
}

// get_async leaves the ordering to its caller (the manager's prefetch): it
// hands back the fence of its copies instead of making compute wait.
TEST_F(SpillTest, GetAsyncHandsBackTheFenceOfItsCopies) {
  GatedTransfer gated;
  host_ = PinnedBuffer(1 << 20, Device::cpu());
  TieredStoreOptions o;
  o.host_tier = &host_;
  TieredSpillStore store(gated, o);
  auto a = random_bytes(5000, 11);
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());
  std::vector<char> back(a.size());
  std::shared_ptr<Fence> done;
  ASSERT_TRUE(store.get_async(1, back.data(), &done).ok());
  ASSERT_NE(done, nullptr);
  EXPECT_FALSE(done->done()) << "the fence is the copy's, not one already passed";
  EXPECT_EQ(gated.compute_waits_calls, 0);
  gated.gate.open();
  EXPECT_TRUE(done->done());
  EXPECT_EQ(back, a);
  // get() orders the compute stream itself.
  ASSERT_TRUE(store.get(1, back.data()).ok());
  EXPECT_EQ(gated.compute_waits_calls, 1);
}

TEST_F(SpillTest, EmptyTensorsDuplicateAndUnknownIds) {
  TieredSpillStore store(*transfer_, file_options());
  char byte = 'x';
  ASSERT_TRUE(store.put(1, &byte, 0, "empty").ok());
  EXPECT_TRUE(store.get(1, &byte).ok());
  EXPECT_EQ(byte, 'x');
  ASSERT_TRUE(store.put(2, &byte, 1, "one").ok());
  Status st = store.put(2, &byte, 1, "again");
  EXPECT_TRUE(st.is_invalid_argument()) << st.to_string();
  EXPECT_TRUE(store.get(99, &byte).is_not_found());
  EXPECT_TRUE(store.wait_copied(99).is_not_found());
  store.erase(99);  // ignored
  store.prefetch(99);
}

TEST_F(SpillTest, GetWhileTheWriteIsInFlightIsServedFromStaging) {
  GatedTransfer gated;
  auto store = std::make_unique<TieredSpillStore>(gated, file_options(8));
  // Whatever happens below, the writes held back must be let go before the
  // store's destructor waits for them.
  struct Opener {
    Gate& g;
    ~Opener() { g.open(); }
  } opener{gated.gate};

  auto data = random_bytes(3 * kChunk + 100, 9);  // 4 chunks, 4 of the 8 slots
  ASSERT_TRUE(store->put(1, data.data(), data.size(), "held").ok());
  EXPECT_FALSE(store->copied(1));
  expect_round_trip(*store, 1, data);
  SpillStats s = store->stats();
  EXPECT_EQ(s.staging_hits, 4u);
  EXPECT_EQ(s.file_bytes_written, 0u);
  EXPECT_EQ(s.file_bytes_read, 0u);

  gated.gate.open();
  ASSERT_TRUE(store->wait_copied(1).ok());
  EXPECT_TRUE(store->copied(1));
  ASSERT_TRUE(store->flush().ok());
  EXPECT_EQ(store->stats().file_bytes_written, 3 * kChunk + 4096);
  // Now from the file.
  expect_round_trip(*store, 1, data);
  s = store->stats();
  EXPECT_EQ(s.staging_hits, 4u);
  EXPECT_EQ(s.file_bytes_read, 3 * kChunk + 4096);
}

TEST_F(SpillTest, PrefetchedChunksAreUsedByTheNextGet) {
  TieredSpillStore store(*transfer_, file_options(8));
  auto a = random_bytes(6 * kChunk, 10);
  auto b = random_bytes(3 * kChunk, 11);
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());
  ASSERT_TRUE(store.put(2, b.data(), b.size(), "b").ok());
  ASSERT_TRUE(store.flush().ok());

  // Prefetch takes at most half the slots (4 of 8); a put needing all eight
  // slots still goes through, and the get reads each chunk exactly once.
  uint64_t read_before = store.stats().file_bytes_read;
  store.prefetch(1);
  auto c = random_bytes(8 * kChunk, 12);
  ASSERT_TRUE(store.put(3, c.data(), c.size(), "c").ok());
  ASSERT_TRUE(store.flush().ok());  // the prefetch reads have finished too
  EXPECT_EQ(store.stats().file_bytes_read - read_before, 4 * kChunk);
  expect_round_trip(store, 1, a);
  EXPECT_EQ(store.stats().file_bytes_read - read_before, 6 * kChunk);

  // Prefetched but never got: erase drops it and frees its slots.
  store.prefetch(2);
  store.erase(2);
  expect_round_trip(store, 3, c);
  auto d = random_bytes(8 * kChunk, 13);
  ASSERT_TRUE(store.put(4, d.data(), d.size(), "d").ok());
  expect_round_trip(store, 4, d);
  // Prefetching an erased or unknown id does nothing.
  store.prefetch(2);
  store.prefetch(77);
  expect_round_trip(store, 1, a);
}

TEST_F(SpillTest, EraseFreesExtentsForReuse) {
  TieredStoreOptions o = file_options();
  o.file_limit = 1 << 20;
  TieredSpillStore store(*transfer_, o);
  auto keep = random_bytes(100000, 14);
  ASSERT_TRUE(store.put(1000, keep.data(), keep.size(), "keep").ok());
  // 50 tensors of 600 KiB through a 1 MiB file: only with reuse.
  for (int i = 0; i < 50; ++i) {
    auto data = random_bytes(600 << 10, static_cast<uint32_t>(100 + i));
    Status st = store.put(i, data.data(), data.size(), "loop");
    ASSERT_TRUE(st.ok()) << "iteration " << i << ": " << st.to_string();
    if (i % 7 == 0) expect_round_trip(store, i, data);
    store.erase(i);
    ASSERT_LE(file_size(store.file_path()), 1 << 20);
  }
  SpillStats s = store.stats();
  EXPECT_EQ(s.file_bytes, keep.size());
  expect_round_trip(store, 1000, keep);
  store.erase(1000);
  EXPECT_EQ(store.stats().file_bytes, 0u);
  EXPECT_EQ(store.stats().host_bytes, 0u);
}

TEST_F(SpillTest, FileSizeStaysBoundedWithoutALimit) {
  TieredSpillStore store(*transfer_, file_options());
  off_t size = -1;
  for (int i = 0; i < 30; ++i) {
    auto data = random_bytes(5 * kChunk + 17, static_cast<uint32_t>(200 + i));
    ASSERT_TRUE(store.put(i, data.data(), data.size(), "loop").ok());
    ASSERT_TRUE(store.flush().ok());
    if (i == 0) size = file_size(store.file_path());
    EXPECT_EQ(file_size(store.file_path()), size) << "iteration " << i;
    store.erase(i);
  }
  EXPECT_GT(size, 0);
}

#ifdef LEASEHOLD_HAVE_CUDA
TEST_F(SpillTest, CudaTieredRoundTrip) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    GTEST_SKIP() << "no CUDA device visible";
  }
  auto cuda = make_transfer(Device::cuda(0));
  host_ = PinnedBuffer(64 << 10, Device::cuda(0));
  staging_ = PinnedBuffer(4 * kChunk, Device::cuda(0));
  TieredStoreOptions o;
  o.host_tier = &host_;
  o.staging = &staging_;
  o.chunk_bytes = kChunk;
  o.directory = dir_;
  o.tag = "cuda";
  TieredSpillStore store(*cuda, o);

  const std::vector<size_t> sizes = {1, 4097, kChunk * 7 / 2, 9 * kChunk + 5};
  std::vector<std::vector<char>> data;
  std::vector<void*> src(sizes.size()), dst(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    data.push_back(random_bytes(sizes[i], static_cast<uint32_t>(40 + i)));
    ASSERT_EQ(cudaMalloc(&src[i], sizes[i]), cudaSuccess);
    ASSERT_EQ(cudaMalloc(&dst[i], sizes[i]), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(src[i], data[i].data(), sizes[i], cudaMemcpyHostToDevice), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (size_t i = 0; i < sizes.size(); ++i) {
    Status st = store.put(i, src[i], sizes[i], "cuda" + std::to_string(i));
    ASSERT_TRUE(st.ok()) << st.to_string();
  }
  // The last tensor straight back, its writes likely still in flight.
  ASSERT_TRUE(store.get(3, dst[3]).ok());
  for (size_t i = 0; i < sizes.size(); ++i) {
    ASSERT_TRUE(store.wait_copied(i).ok());
    // The store has its copy: overwrite the source.
    ASSERT_EQ(cudaMemset(src[i], 0, sizes[i]), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_TRUE(store.flush().ok());
  store.prefetch(2);
  for (size_t i = 0; i < 3; ++i) ASSERT_TRUE(store.get(i, dst[i]).ok());
  engine::synchronize(0);  // the compute stream waits for the copies
  for (size_t i = 0; i < sizes.size(); ++i) {
    std::vector<char> got(sizes[i]);
    ASSERT_EQ(cudaMemcpy(got.data(), dst[i], sizes[i], cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_TRUE(got == data[i]) << "tensor " << i;
    cudaFree(src[i]);
    cudaFree(dst[i]);
  }
  SpillStats s = store.stats();
  EXPECT_EQ(s.host_bytes, sizes[0] + sizes[1]);
  EXPECT_EQ(s.file_bytes, sizes[2] + sizes[3]);
  EXPECT_GT(s.copy_busy_seconds, 0.0);
}
#endif

}  // namespace
}  // namespace leasehold::spill
