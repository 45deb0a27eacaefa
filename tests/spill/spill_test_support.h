// What the spill store tests share: odd sizes, random bytes, read-backs,
// transfers whose fences a test holds or faults, and the fixture with its
// temporary directory and file-tier options.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <thread>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <stdexcept>
#include <vector>

#include "agent/spill/fault_store.h"
#include "agent/spill/memory_store.h"
#include "agent/spill/tiered_store.h"
#include "agent/spill/transfer.h"
#include "shared/process.h"

namespace leasehold::spill::test {

namespace fs = std::filesystem;
using engine::Device;

inline constexpr size_t kChunk = 64 << 10;
// Odd sizes: one byte, either side of a page, and three and a half chunks.
inline const std::vector<size_t> kOddSizes = {1, 4095, 4097, kChunk * 7 / 2};

inline std::vector<char> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(gen());
  return v;
}

// Reads `id` back into a fresh buffer (filled with a pattern the data is
// unlikely to have, so a missed byte shows).
inline std::vector<char> read_back(SpillStore& store, SpillId id, size_t n, Status* st) {
  std::vector<char> out(n, '\x5a');
  *st = store.get(id, out.data());
  return out;
}

inline void expect_round_trip(SpillStore& store, SpillId id, const std::vector<char>& want) {
  Status st;
  auto got = read_back(store, id, want.size(), &st);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(got == want) << "bytes of id " << id << " (" << want.size() << " bytes) differ";
}

inline uint64_t sum(const std::vector<size_t>& v) {
  uint64_t s = 0;
  for (size_t x : v) s += x;
  return s;
}

inline off_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? st.st_size : -1;
}

// A transfer that copies at once (host memory) but whose fences stay not
// done until the test opens the gate: the store then sees copies in flight,
// and its writes wait for them, as on a busy GPU.
class Gate {
 public:
  void open() {
    {
      std::lock_guard lock(mu_);
      open_ = true;
    }
    cv_.notify_all();
  }
  bool is_open() {
    std::lock_guard lock(mu_);
    return open_;
  }
  void wait() {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool open_ = false;
};

class GatedFence final : public Fence {
 public:
  explicit GatedFence(Gate& gate) : gate_(gate) {}
  bool done() override { return gate_.is_open(); }
  void wait() override { gate_.wait(); }

 private:
  Gate& gate_;
};

class GatedTransfer final : public Transfer {
 public:
  Device device() const override { return Device::cpu(); }
  void to_host(void* host, const void* src, size_t n) override { std::memcpy(host, src, n); }
  void to_device(void* dst, const void* host, size_t n) override { std::memcpy(dst, host, n); }
  std::shared_ptr<Fence> mark() override { return std::make_shared<GatedFence>(gate); }
  void compute_waits(const std::shared_ptr<Fence>&) override { ++compute_waits_calls; }
  double busy_seconds() override { return 0; }
  Gate gate;
  int compute_waits_calls = 0;
};

// A transfer whose device faults: every fence throws, as a CUDA fence does
// after a kernel fault.
class FaultyFence final : public Fence {
 public:
  bool done() override { throw std::runtime_error("device fault (test)"); }
  void wait() override { throw std::runtime_error("device fault (test)"); }
};

class FaultyTransfer final : public Transfer {
 public:
  Device device() const override { return Device::cpu(); }
  void to_host(void* host, const void* src, size_t n) override { std::memcpy(host, src, n); }
  void to_device(void* dst, const void* host, size_t n) override { std::memcpy(dst, host, n); }
  std::shared_ptr<Fence> mark() override { return std::make_shared<FaultyFence>(); }
  void compute_waits(const std::shared_ptr<Fence>&) override {}
  double busy_seconds() override { return 0; }
};

class SpillTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/leasehold-spill-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl)) << std::strerror(errno);
    dir_ = tmpl;
    transfer_ = make_transfer(Device::cpu());
  }
  void TearDown() override { fs::remove_all(dir_); }

  // File tier only unless a host tier is given.
  TieredStoreOptions file_options(int slots = 4) {
    staging_ = PinnedBuffer(slots * kChunk, Device::cpu());
    TieredStoreOptions o;
    o.staging = &staging_;
    o.chunk_bytes = kChunk;
    o.directory = dir_;
    o.tag = "t";
    o.io_threads = 2;
    return o;
  }

  std::string spill_name(int pid, const std::string& tag) const {
    return dir_ + "/spill-" + std::to_string(pid) + "-" + tag + ".bin";
  }

  std::string dir_;
  std::unique_ptr<Transfer> transfer_;
  PinnedBuffer staging_;
  PinnedBuffer host_;
};

}  // namespace leasehold::spill::test
