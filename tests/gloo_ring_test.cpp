// GlooRing: the all-reduce the host backend's data-parallel jobs use. The
// replicas are threads here, each with its own Gloo context over TCP on
// the loopback.
#include "agent/gloo_ring.h"

#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/hash_store.h>
#include <gloo/transport/tcp/device.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <memory>
#include <thread>
#include <vector>

namespace leasehold {
namespace {

using namespace std::chrono_literals;
using Contexts = std::vector<std::shared_ptr<gloo::rendezvous::Context>>;

// A full mesh of `size` contexts, connected through one in-memory store.
Contexts connect(int size) {
  gloo::rendezvous::HashStore store;
  Contexts contexts(static_cast<size_t>(size));
  std::vector<std::thread> threads;
  for (int r = 0; r < size; ++r) {
    threads.emplace_back([&, r] {
      auto device = gloo::transport::tcp::CreateDevice(gloo::transport::tcp::attr("127.0.0.1"));
      auto context = std::make_shared<gloo::rendezvous::Context>(r, size);
      context->setTimeout(60s);
      context->connectFullMesh(store, device);
      contexts[static_cast<size_t>(r)] = context;
    });
  }
  for (auto& t : threads) t.join();
  return contexts;
}

float value(int rank, size_t i) { return static_cast<float>(rank + 1) * 0.1f + static_cast<float>(i % 97); }

TEST(GlooRing, SumsOverEveryRankAndEveryRankGetsTheSameBits) {
  for (int size : {2, 3, 4}) {
    Contexts contexts = connect(size);
    std::vector<std::unique_ptr<GlooRing>> rings;
    for (auto& c : contexts) rings.push_back(std::make_unique<GlooRing>(c, 60s));
    // Fewer elements than ranks (empty chunks), uneven chunks, and more
    // than one all-reduce on the same rings.
    for (size_t n : {size_t{1}, size_t{2}, size_t{5}, size_t{1000}, size_t{100003}}) {
      std::vector<std::vector<float>> data(static_cast<size_t>(size), std::vector<float>(n));
      for (int r = 0; r < size; ++r) {
        for (size_t i = 0; i < n; ++i) data[static_cast<size_t>(r)][i] = value(r, i);
      }
      std::vector<std::future<bool>> done;
      for (int r = 0; r < size; ++r) {
        done.push_back(std::async(std::launch::async, [&, r] {
          return rings[static_cast<size_t>(r)]->allreduce(data[static_cast<size_t>(r)].data(), n);
        }));
      }
      for (auto& d : done) ASSERT_TRUE(d.get()) << "size " << size << ", n " << n;
      for (size_t i = 0; i < n; ++i) {
        float expected = 0;
        for (int r = 0; r < size; ++r) expected += value(r, i);
        ASSERT_NEAR(data[0][i], expected, 1e-3f * expected) << "size " << size << ", n " << n << ", i " << i;
      }
      for (int r = 1; r < size; ++r) {
        ASSERT_EQ(0, std::memcmp(data[0].data(), data[static_cast<size_t>(r)].data(), n * sizeof(float)))
            << "rank " << r << " differs from rank 0 (size " << size << ", n " << n << ")";
      }
    }
  }
}

// The wait a replica is in when its peer stops first: abort() ends it.
TEST(GlooRing, AbortEndsAWaitForAPeerThatNeverJoins) {
  Contexts contexts = connect(2);
  GlooRing ring(contexts[0], 10min);
  std::vector<float> data(4096, 1.0f);
  auto done = std::async(std::launch::async, [&] { return ring.allreduce(data.data(), data.size()); });
  EXPECT_EQ(done.wait_for(300ms), std::future_status::timeout);  // it waits for rank 1
  ring.abort();
  ASSERT_EQ(done.wait_for(60s), std::future_status::ready) << "abort() did not end the wait";
  EXPECT_FALSE(done.get());
  // Every later all-reduce ends at once.
  EXPECT_FALSE(ring.allreduce(data.data(), data.size()));
}

// A peer that leaves mid-collective (its agent died, its job failed) ends
// the wait with an error, which the reducer reports as a lost replica.
TEST(GlooRing, APeerThatLeavesEndsTheWaitWithAnError) {
  Contexts contexts = connect(2);
  GlooRing ring(contexts[0], 10min);
  std::vector<float> data(4096, 1.0f);
  auto done = std::async(std::launch::async, [&] { return ring.allreduce(data.data(), data.size()); });
  std::this_thread::sleep_for(200ms);
  contexts[1].reset();  // rank 1's connections close
  ASSERT_EQ(done.wait_for(60s), std::future_status::ready) << "rank 1 leaving did not end the wait";
  EXPECT_THROW(done.get(), std::exception);
}

}  // namespace
}  // namespace leasehold
