// The spill stores' faults and limits, on the host backend against real
// files in a temporary directory: a corrupted chunk, a full file, a file
// that cannot grow, an unusable directory, a device fault during a spill,
// spill files removed with their store and stale files of dead processes,
// the fault-injecting store, and a random workload that keeps every byte.
#include <gtest/gtest.h>

#include "tests/spill/spill_test_support.h"

namespace leasehold::spill {
namespace {

using namespace test;  // NOLINT(google-build-using-namespace): the tests' shared helpers

TEST_F(SpillTest, CorruptedChunkIsReportedNamingTensorAndFile) {
  TieredSpillStore store(*transfer_, file_options());
  auto a = random_bytes(3 * kChunk, 15);
  auto b = random_bytes(kChunk, 16);
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "encoder.attn.weight").ok());
  ASSERT_TRUE(store.put(2, b.data(), b.size(), "other").ok());
  ASSERT_TRUE(store.flush().ok());

  // The first tensor starts at offset 0: damage its second chunk.
  int fd = ::open(store.file_path().c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << std::strerror(errno);
  const char junk[16] = "not the data";
  ASSERT_EQ(::pwrite(fd, junk, sizeof junk, kChunk + 1000), static_cast<ssize_t>(sizeof junk));
  ASSERT_EQ(::fdatasync(fd), 0);
  ::close(fd);

  for (int attempt = 0; attempt < 2; ++attempt) {
    Status st;
    read_back(store, 1, a.size(), &st);
    ASSERT_TRUE(st.is_corruption()) << st.to_string();
    EXPECT_NE(st.message().find("encoder.attn.weight"), std::string::npos) << st.message();
    EXPECT_NE(st.message().find(store.file_path()), std::string::npos) << st.message();
    EXPECT_NE(st.message().find("checksum mismatch in chunk 1"), std::string::npos) << st.message();
  }
  expect_round_trip(store, 2, b);
  store.erase(1);
  auto c = random_bytes(4 * kChunk, 17);
  ASSERT_TRUE(store.put(3, c.data(), c.size(), "c").ok());
  expect_round_trip(store, 3, c);
}

TEST_F(SpillTest, FileLimitGivesEnospcAndKeepsEarlierTensors) {
  TieredStoreOptions o = file_options();
  o.file_limit = 1 << 20;
  TieredSpillStore store(*transfer_, o);
  auto a = random_bytes(512 << 10, 18);
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());
  auto big = random_bytes(2 << 20, 19);
  Status st = store.put(2, big.data(), big.size(), "huge.activation");
  ASSERT_TRUE(st.is_io_error()) << st.to_string();
  EXPECT_EQ(st.error_number(), ENOSPC);
  EXPECT_NE(st.message().find("huge.activation"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(store.file_path()), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("limit of 1.00 MiB"), std::string::npos) << st.message();
  EXPECT_TRUE(store.get(2, big.data()).is_not_found());
  expect_round_trip(store, 1, a);
  // Not sticky: what fits still goes in.
  auto b = random_bytes(256 << 10, 20);
  ASSERT_TRUE(store.put(3, b.data(), b.size(), "b").ok());
  expect_round_trip(store, 3, b);
  expect_round_trip(store, 1, a);
  EXPECT_LE(file_size(store.file_path()), 1 << 20);
}

// The file cannot grow: RLIMIT_FSIZE makes fallocate fail with EFBIG as a
// full disk makes it fail with ENOSPC.
TEST_F(SpillTest, FailingGrowthNamesTheFileAndItsErrno) {
  struct rlimit old_limit;
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old_limit), 0);
  struct sigaction ignore {
  }, old_action{};
  ignore.sa_handler = SIG_IGN;
  ASSERT_EQ(::sigaction(SIGXFSZ, &ignore, &old_action), 0);
  struct rlimit small = old_limit;
  small.rlim_cur = 1 << 20;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  Status st;
  std::string path;
  {
    TieredSpillStore store(*transfer_, file_options());
    auto a = random_bytes(kChunk, 21);
    st = store.put(1, a.data(), a.size(), "a");
    path = spill_name(::getpid(), "t");
  }
  ::setrlimit(RLIMIT_FSIZE, &old_limit);
  ::sigaction(SIGXFSZ, &old_action, nullptr);
  ASSERT_TRUE(st.is_io_error()) << st.to_string();
  EXPECT_EQ(st.error_number(), EFBIG) << st.to_string();
  EXPECT_NE(st.message().find("cannot grow spill file " + path), std::string::npos) << st.message();
  EXPECT_NE(st.message().find(std::strerror(EFBIG)), std::string::npos) << st.message();
  EXPECT_FALSE(fs::exists(path));  // removed with the store
}

TEST_F(SpillTest, UnusableDirectoryIsReportedByPut) {
  // A directory below a regular file: fails for root too, unlike chmod.
  std::ofstream(dir_ + "/afile") << "x";
  host_ = PinnedBuffer(8192, Device::cpu());
  TieredStoreOptions o = file_options();
  o.directory = dir_ + "/afile/sub";
  o.host_tier = &host_;
  TieredSpillStore store(*transfer_, o);
  auto big = random_bytes(kChunk, 22);
  for (int attempt = 0; attempt < 2; ++attempt) {
    Status st = store.put(1, big.data(), big.size(), "big");
    ASSERT_TRUE(st.is_io_error()) << st.to_string();
    EXPECT_EQ(st.error_number(), ENOTDIR);
    EXPECT_NE(st.message().find("cannot create spill file " + dir_ + "/afile/sub/spill-" +
                                std::to_string(::getpid()) + "-t.bin: Not a directory"),
              std::string::npos)
        << st.message();
  }
  EXPECT_TRUE(store.file_path().empty());
  // The host tier still works.
  auto small = random_bytes(100, 23);
  ASSERT_TRUE(store.put(2, small.data(), small.size(), "small").ok());
  expect_round_trip(store, 2, small);
}

TEST_F(SpillTest, DeviceFaultFailsTheTensorAndLaterPuts) {
  FaultyTransfer faulty;
  TieredSpillStore store(faulty, file_options());
  auto a = random_bytes(2 * kChunk, 24);
  // The copy is queued; its fault shows when the store waits for it.
  ASSERT_TRUE(store.put(1, a.data(), a.size(), "victim").ok());
  Status st = store.wait_copied(1);
  ASSERT_TRUE(st.is_io_error()) << st.to_string();
  EXPECT_NE(st.message().find("victim"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("device fault (test)"), std::string::npos) << st.message();
  EXPECT_TRUE(store.copied(1));  // never blocks, never throws
  EXPECT_FALSE(store.flush().ok());
  read_back(store, 1, a.size(), &st);
  EXPECT_TRUE(st.is_io_error()) << st.to_string();
  Status later = store.put(2, a.data(), a.size(), "later");
  EXPECT_TRUE(later.is_io_error()) << later.to_string();
  store.erase(1);
}

TEST_F(SpillTest, SpillFileIsRemovedWithTheStore) {
  std::string path;
  {
    TieredSpillStore store(*transfer_, file_options());
    auto a = random_bytes(kChunk + 1, 25);
    ASSERT_TRUE(store.put(1, a.data(), a.size(), "a").ok());
    path = store.file_path();
    EXPECT_TRUE(fs::exists(path));
    // Destroyed with a write possibly in flight and the tensor not erased.
  }
  EXPECT_FALSE(fs::exists(path));
}

TEST_F(SpillTest, StaleFilesOfDeadProcessesAreRemoved) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) ::_exit(0);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(process_gone(child));

  std::string dead = spill_name(child, "x");
  std::string mine = spill_name(::getpid(), "x");
  std::string init = spill_name(1, "x");  // pid 1 runs as long as the system does
  std::string other = dir_ + "/spill-notapid-x.bin";
  for (const auto& p : {dead, mine, init, other}) std::ofstream(p) << "x";
  EXPECT_EQ(remove_stale_spill_files(dir_), 1);
  EXPECT_FALSE(fs::exists(dead));
  EXPECT_TRUE(fs::exists(mine));
  EXPECT_TRUE(fs::exists(init));
  EXPECT_TRUE(fs::exists(other));
  EXPECT_EQ(remove_stale_spill_files(dir_), 0);
  EXPECT_EQ(remove_stale_spill_files(dir_ + "/missing"), 0);
}

TEST_F(SpillTest, FaultStoreInjectsEnospcEioAndCorruption) {
  MemorySpillStore inner(*transfer_);
  FaultInjectingSpillStore store(inner);
  store.fail_put_at(3);
  std::vector<std::vector<char>> data;
  for (int i = 0; i < 4; ++i) data.push_back(random_bytes(1000 + i, static_cast<uint32_t>(30 + i)));
  ASSERT_TRUE(store.put(1, data[0].data(), data[0].size(), "one").ok());
  ASSERT_TRUE(store.put(2, data[1].data(), data[1].size(), "two").ok());
  Status st = store.put(3, data[2].data(), data[2].size(), "three");
  ASSERT_TRUE(st.is_io_error()) << st.to_string();
  EXPECT_EQ(st.error_number(), ENOSPC);
  EXPECT_NE(st.message().find("three"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("(injected)"), std::string::npos) << st.message();
  EXPECT_TRUE(inner.wait_copied(3).is_not_found());  // nothing stored
  ASSERT_TRUE(store.put(4, data[3].data(), data[3].size(), "four").ok());
  EXPECT_EQ(store.puts(), 4u);

  store.fail_get_of(1);
  store.corrupt_get_of(2);
  read_back(store, 1, data[0].size(), &st);
  EXPECT_TRUE(st.is_io_error()) << st.to_string();
  EXPECT_EQ(st.error_number(), EIO);
  read_back(store, 2, data[1].size(), &st);
  EXPECT_TRUE(st.is_corruption()) << st.to_string();
  EXPECT_NE(st.message().find("two"), std::string::npos) << st.message();
  expect_round_trip(store, 4, data[3]);
  EXPECT_EQ(store.gets(), 3u);

  // The inner store's tensors are intact.
  expect_round_trip(inner, 1, data[0]);
  expect_round_trip(inner, 2, data[1]);
  store.clear_faults();
  expect_round_trip(store, 1, data[0]);
  expect_round_trip(store, 2, data[1]);
  store.erase(1);
  EXPECT_TRUE(inner.wait_copied(1).is_not_found());
}

// Many puts, gets, prefetches and erases in random order through two slots
// and three I/O threads, against a model of what each id holds.
TEST_F(SpillTest, RandomWorkloadKeepsEveryByte) {
  host_ = PinnedBuffer(256 << 10, Device::cpu());
  TieredStoreOptions o = file_options(2);
  o.host_tier = &host_;
  o.io_threads = 3;
  TieredSpillStore store(*transfer_, o);
  std::mt19937 gen(42);
  std::map<SpillId, std::vector<char>> model;
  SpillId next = 1;
  for (int step = 0; step < 400; ++step) {
    int op = static_cast<int>(gen() % 10);
    if (op < 4 || model.empty()) {
      size_t n = 1 + gen() % (4 * kChunk);
      auto data = random_bytes(n, gen());
      Status st = store.put(next, data.data(), data.size(), "r" + std::to_string(next));
      ASSERT_TRUE(st.ok()) << st.to_string();
      if (gen() % 2) {
        ASSERT_TRUE(store.wait_copied(next).ok());
      }
      model[next++] = std::move(data);
      continue;
    }
    auto it = model.begin();
    std::advance(it, gen() % model.size());
    if (op < 6) {
      store.prefetch(it->first);
    } else if (op < 9) {
      expect_round_trip(store, it->first, it->second);
    } else {
      store.erase(it->first);
      model.erase(it);
    }
  }
  for (auto& [id, data] : model) expect_round_trip(store, id, data);
  SpillStats s = store.stats();
  uint64_t held = 0;
  for (auto& [id, data] : model) held += data.size();
  EXPECT_EQ(s.host_bytes + s.file_bytes, held);
  EXPECT_GT(s.host_bytes, 0u);
  EXPECT_GT(s.file_bytes, 0u);
  ASSERT_TRUE(store.flush().ok());
}

}  // namespace
}  // namespace leasehold::spill
