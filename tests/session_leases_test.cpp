// The PyTorch plug-in's lease source (torch_plugin/session_leases.h) on a
// real session with a host-backend coordinator: segments leased in pieces,
// free stretches of partly used segments going back a whole piece at a
// time, the stock backing new segments from its fullest leases, and pieces
// given back when one of a segment's is refused.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "lease_client/leasehold.h"
#include "tests/support/cluster.h"
#include "torch_plugin/session_leases.h"

namespace leasehold::testing {
namespace {

using torch_plugin::Lease;
using torch_plugin::LeaseSource;
using torch_plugin::SessionLeases;

constexpr uint64_t kPage = 64 * 1024;  // the pool's alignment below
constexpr uint64_t kPoolBytes = 64ull << 20;

class SessionLeasesOnHost : public ::testing::Test {
 protected:
  void SetUp() override {
    cluster.start_coordinator({"--backend", "host", "--pool-size", "64MiB", "--alignment", "64KiB",
                               "--lease-wait-timeout", "300ms"});
    lh_session_options o;
    lh_session_options_init(&o);
    o.endpoint = cluster.endpoint().c_str();
    o.name = "session-leases";
    o.register_timeout_ms = 5000;
    ASSERT_EQ(lh_session_open(&o, &session), LH_OK) << lh_last_error();
  }
  void TearDown() override {
    leases.reset();
    if (session) lh_session_close(session);
  }
  // A lease source over the session with leases of at most `piece_pages`.
  void make(uint64_t piece_pages) {
    leases = std::make_unique<SessionLeases>(
        session, kPage, 64 * kPage, 0, piece_pages * kPage,
        [this](const std::string& why) { lost.push_back(why); });
  }
  lh_session_stats stats() const {
    lh_session_stats st{};
    EXPECT_EQ(lh_session_stats_get(session, &st), LH_OK) << lh_last_error();
    return st;
  }
  // A segment of `pages`; base nullptr when it was not granted (a test
  // failure already).
  Lease acquire(uint64_t pages) {
    Lease l;
    std::string why;
    EXPECT_EQ(leases->acquire(pages * kPage, false, &l, &why), LeaseSource::Result::kGranted)
        << why;
    return l;
  }

  Cluster cluster;
  lh_session* session = nullptr;
  std::vector<std::string> lost;  // before `leases`, whose callback writes it
  std::unique_ptr<SessionLeases> leases;
};

// Page k of a segment holds bytes of value `seed + k`.
void fill(const Lease& l, uint64_t first_page, uint64_t pages, int seed) {
  for (uint64_t k = first_page; k < first_page + pages; ++k) {
    std::memset(static_cast<std::byte*>(l.base) + k * kPage, seed + int(k), kPage);
  }
}
bool holds(const Lease& l, uint64_t first_page, uint64_t pages, int seed) {
  std::vector<unsigned char> want(kPage);
  for (uint64_t k = first_page; k < first_page + pages; ++k) {
    std::memset(want.data(), seed + int(k), kPage);
    if (std::memcmp(static_cast<std::byte*>(l.base) + k * kPage, want.data(), kPage) != 0) {
      return false;
    }
  }
  return true;
}

TEST_F(SessionLeasesOnHost, FreeStretchesGoBackAWholePieceAtATime) {
  make(2);
  Lease seg = acquire(8);
  ASSERT_NE(seg.base, nullptr);
  ASSERT_EQ(seg.size, 8 * kPage);
  EXPECT_EQ(stats().leases, 4u);
  EXPECT_EQ(stats().leased_bytes, 8 * kPage);
  fill(seg, 0, 8, 1);

  // Pages 0-2 free: the first piece is wholly free and goes back; the
  // second still shows page 3.
  leases->unback(seg.id, 0, 3 * kPage);
  EXPECT_EQ(leases->give_back_unused(), 2 * kPage);
  EXPECT_EQ(stats().leases, 3u);
  EXPECT_EQ(stats().leased_bytes, 6 * kPage);
  EXPECT_TRUE(holds(seg, 3, 5, 1));
  EXPECT_EQ(leases->give_back_unused(), 0u);

  // Page 3 free too: the second piece goes.
  leases->unback(seg.id, 3 * kPage, kPage);
  EXPECT_EQ(leases->give_back_unused(), 2 * kPage);
  EXPECT_EQ(stats().leased_bytes, 4 * kPage);
  EXPECT_TRUE(holds(seg, 4, 4, 1));

  leases->release(seg.id);
  EXPECT_EQ(stats().leases, 0u);
  EXPECT_EQ(stats().leased_bytes, 0u);
  EXPECT_TRUE(lost.empty());
}

TEST_F(SessionLeasesOnHost, WithoutPiecesASegmentIsOneLease) {
  make(0);
  Lease seg = acquire(8);
  ASSERT_NE(seg.base, nullptr);
  EXPECT_EQ(stats().leases, 1u);
  // Half of it free: nothing can go back while the rest shows.
  leases->unback(seg.id, 0, 4 * kPage);
  EXPECT_EQ(leases->give_back_unused(), 0u);
  EXPECT_EQ(stats().leased_bytes, 8 * kPage);
  leases->release(seg.id);
  EXPECT_EQ(stats().leased_bytes, 0u);
}

TEST_F(SessionLeasesOnHost, TheStockBacksNewSegmentsFromItsFullestLeaseFirst) {
  make(4);
  Lease a = acquire(8);  // pages 0-3: one lease, 4-7: another
  ASSERT_NE(a.base, nullptr);
  ASSERT_EQ(stats().leases, 2u);
  fill(a, 0, 8, 10);
  leases->unback(a.id, 0, 3 * kPage);  // the first lease: 3 of 4 pages free
  leases->unback(a.id, 4 * kPage, kPage);  // the second: 1 of 4
  EXPECT_EQ(leases->give_back_unused(), 0u);

  // A page from the stock, no new lease: from the second lease, whose
  // pages are mostly in use.
  Lease b = acquire(1);
  ASSERT_NE(b.base, nullptr);
  EXPECT_EQ(stats().leases, 2u);
  fill(b, 0, 1, 50);
  // So freeing the first lease's last page in use frees it whole.
  leases->unback(a.id, 3 * kPage, kPage);
  EXPECT_EQ(leases->give_back_unused(), 4 * kPage);
  EXPECT_EQ(stats().leases, 1u);
  EXPECT_TRUE(holds(a, 5, 3, 10));
  EXPECT_TRUE(holds(b, 0, 1, 50));

  leases->release(a.id);
  leases->release(b.id);
  EXPECT_EQ(stats().leases, 0u);
}

TEST_F(SessionLeasesOnHost, ASegmentWhosePieceIsRefusedKeepsNoneOfItsPieces) {
  make(2);
  // Everything but 3 pages taken by another lease of the session: the
  // second piece of a 4-page segment cannot come.
  lh_lease* filler = nullptr;
  ASSERT_EQ(lh_lease_acquire(session, kPoolBytes - 3 * kPage, 0, 0, &filler), LH_OK)
      << lh_last_error();
  std::unique_ptr<lh_lease, lh_status (*)(lh_lease*)> filler_held(filler, lh_lease_release);
  Lease l;
  std::string why;
  EXPECT_EQ(leases->acquire(4 * kPage, false, &l, &why), LeaseSource::Result::kRefused);
  EXPECT_FALSE(why.empty());
  EXPECT_EQ(stats().leases, 1u);
  EXPECT_EQ(stats().leased_bytes, kPoolBytes - 3 * kPage);
  EXPECT_EQ(leases->give_back_unused(), 0u);  // no piece was kept in the stock

  // With the room back the same segment comes.
  ASSERT_EQ(lh_lease_release(filler_held.release()), LH_OK) << lh_last_error();
  Lease seg = acquire(4);
  ASSERT_NE(seg.base, nullptr);
  EXPECT_EQ(seg.size, 4 * kPage);
  EXPECT_EQ(stats().leases, 2u);
  fill(seg, 0, 4, 3);
  EXPECT_TRUE(holds(seg, 0, 4, 3));
  leases->release(seg.id);
  EXPECT_EQ(stats().leases, 0u);
  EXPECT_TRUE(lost.empty());
}

TEST_F(SessionLeasesOnHost, DestroyedItGivesEveryLeaseBackSegmentsInUseIncluded) {
  make(2);
  Lease a = acquire(5);
  Lease b = acquire(3);
  ASSERT_NE(a.base, nullptr);
  ASSERT_NE(b.base, nullptr);
  leases->unback(a.id, 0, kPage);  // a page in the stock as well
  EXPECT_EQ(stats().leases, 5u);   // 2+2+1 and 2+1 pages
  leases.reset();
  EXPECT_EQ(stats().leases, 0u);
  EXPECT_EQ(stats().leased_bytes, 0u);
  EXPECT_TRUE(lost.empty());
}

}  // namespace
}  // namespace leasehold::testing
