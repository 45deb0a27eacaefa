#include "coordinator/lease_table.h"

#include <gtest/gtest.h>

namespace leasehold {
namespace {

constexpr uint64_t kAlign = 4096;
const auto t0 = Clock::now();

LeaseOwner agent(const char* name) { return LeaseOwner::agent(name); }

PendingRequest req(const std::string& owner, uint64_t size, int deadline_ms = 1000,
                   uint64_t request_id = 1) {
  return PendingRequest{LeaseOwner::agent(owner),
                        size,
                        PoolAllocator::End::Low,
                        t0 + std::chrono::milliseconds(deadline_ms),
                        {"rid-" + owner, request_id}};
}

TEST(LeaseTable, GrantRefuseAndOwnership) {
  LeaseTable t(16 * kAlign, kAlign);
  auto a = std::get<LeaseRecord>(t.request(req("a", 3 * kAlign), true));
  EXPECT_EQ(a.owner.name, "a");
  EXPECT_EQ(a.generation, 1u);
  auto too_big = std::get<Refusal>(t.request(req("b", 17 * kAlign), true));
  EXPECT_EQ(too_big.code, ErrorCode::TooLarge);
  EXPECT_NE(too_big.message.find("can never fit"), std::string::npos);
  EXPECT_EQ(std::get<Refusal>(t.request(req("b", 0), true)).code, ErrorCode::InvalidArgument);

  auto not_owner = t.release(agent("b"), a.id);
  ASSERT_TRUE(not_owner);
  EXPECT_EQ(not_owner->code, ErrorCode::NotOwner);
  EXPECT_EQ(t.leases().size(), 1u) << "a refused release changes nothing";
  EXPECT_EQ(std::get<Refusal>(t.resize(agent("b"), a.id, kAlign)).code, ErrorCode::NotOwner);
  EXPECT_EQ(t.release(agent("a"), 999)->code, ErrorCode::NoSuchLease);
  EXPECT_FALSE(t.release(agent("a"), a.id));
  EXPECT_EQ(t.allocator().free_bytes(), 16 * kAlign);
}

TEST(LeaseTable, ResizeBumpsGeneration) {
  LeaseTable t(16 * kAlign, kAlign);
  auto a = std::get<LeaseRecord>(t.request(req("a", kAlign), true));
  auto grown = std::get<LeaseRecord>(t.resize(agent("a"), a.id, 4 * kAlign));
  EXPECT_EQ(grown.size, 4 * kAlign);
  EXPECT_EQ(grown.offset, a.offset);
  EXPECT_EQ(grown.generation, 2u);
  auto b = std::get<LeaseRecord>(t.request(req("b", kAlign), true));
  (void)b;
  EXPECT_EQ(std::get<Refusal>(t.resize(agent("a"), a.id, 8 * kAlign)).code, ErrorCode::NoSpace);
  EXPECT_EQ(t.leases().at(a.id).size, 4 * kAlign) << "failed grow leaves the lease as it was";
}

// An agent whose own leases are all that stand in the way would wait for
// itself until its deadline (seen: a job with the whole pool as its budget
// lost 10 s per fragmented request): it is refused at once instead.
TEST(LeaseTable, ARequestOnlyTheRequestersOwnLeasesBlockIsRefusedAtOnce) {
  LeaseTable t(8 * kAlign, kAlign);
  auto a1 = std::get<LeaseRecord>(t.request(req("a", 2 * kAlign), true));  // [0,2)
  auto a2 = std::get<LeaseRecord>(t.request(req("a", 2 * kAlign), true));  // [2,4)
  auto a3 = std::get<LeaseRecord>(t.request(req("a", 2 * kAlign), true));  // [4,6)
  ASSERT_FALSE(t.release(agent("a"), a2.id));  // free [2,4) and [6,8): 4 pages in pieces
  auto self = std::get<Refusal>(t.request(req("a", 3 * kAlign), true));
  EXPECT_EQ(self.code, ErrorCode::NoSpace);
  EXPECT_NE(self.message.find("only agent 'a''s own leases (16.00 KiB) stand in the way"),
            std::string::npos)
      << self.message;
  EXPECT_EQ(t.waiting(), 0u);
  // Another agent's request waits: a's leases may come back.
  EXPECT_TRUE(std::holds_alternative<LeaseTable::Queued>(t.request(req("b", 3 * kAlign), true)));
  // Once someone else holds memory, a waits too (it may come back) unless
  // even all of it could not make room.
  ASSERT_FALSE(t.release(agent("a"), a3.id));
  auto c = std::get<LeaseRecord>(t.request(req("c", kAlign), true));
  (void)c;
  (void)a1;
  EXPECT_TRUE(std::holds_alternative<LeaseTable::Queued>(t.request(req("a", 6 * kAlign), true)));
  EXPECT_EQ(std::get<Refusal>(t.request(req("a", 7 * kAlign), true)).code, ErrorCode::NoSpace)
      << "the pool less a's own 2 pages is too small";
}

TEST(LeaseTable, WaitingRequestsGrantedInOrderWithoutHeadOfLineBlocking) {
  LeaseTable t(8 * kAlign, kAlign);
  auto a = std::get<LeaseRecord>(t.request(req("a", 4 * kAlign), true));  // [0,4)
  auto x = std::get<LeaseRecord>(t.request(req("x", 2 * kAlign), true));  // [4,6)
  EXPECT_TRUE(std::holds_alternative<LeaseTable::Queued>(t.request(req("b", 5 * kAlign), true)));
  EXPECT_TRUE(std::holds_alternative<LeaseTable::Queued>(t.request(req("c", 3 * kAlign), true)));
  EXPECT_EQ(std::get<Refusal>(t.request(req("d", 3 * kAlign), false)).code, ErrorCode::NoSpace);
  EXPECT_EQ(t.waiting(), 2u);
  EXPECT_TRUE(t.grant_waiting().empty());

  ASSERT_FALSE(t.release(agent("x"), x.id));  // free: [4,8)
  auto granted = t.grant_waiting();
  ASSERT_EQ(granted.size(), 1u) << "b (5) still does not fit; c (3) behind it does";
  EXPECT_EQ(granted[0].lease.owner.name, "c");
  EXPECT_EQ(granted[0].reply_to.routing_id, "rid-c");
  EXPECT_EQ(t.waiting(), 1u);

  ASSERT_FALSE(t.release(agent("a"), a.id));
  ASSERT_FALSE(t.release(agent("c"), granted[0].lease.id));
  granted = t.grant_waiting();
  ASSERT_EQ(granted.size(), 1u);
  EXPECT_EQ(granted[0].lease.owner.name, "b");
  EXPECT_EQ(t.waiting(), 0u);
}

TEST(LeaseTable, DeadlinesExpireAndOwnersDropTheirRequests) {
  LeaseTable t(4 * kAlign, kAlign);
  auto a = std::get<LeaseRecord>(t.request(req("a", 4 * kAlign), true));
  (void)a;
  t.request(req("b", kAlign, 100, 7), true);
  t.request(req("c", kAlign, 500, 8), true);
  EXPECT_EQ(t.next_deadline(), t0 + std::chrono::milliseconds(100));
  auto expired = t.expire(t0 + std::chrono::milliseconds(100));
  ASSERT_EQ(expired.size(), 1u);
  EXPECT_EQ(expired[0].refusal.code, ErrorCode::Timeout);
  EXPECT_EQ(expired[0].reply_to.request_id, 7u);
  auto [count, bytes] = t.release_all(agent("c"));
  EXPECT_EQ(count, 0u);
  EXPECT_EQ(t.waiting(), 0u) << "a departed agent's waiting requests go with it";
  auto [ca, ba] = t.release_all(agent("a"));
  EXPECT_EQ(ca, 1u);
  EXPECT_EQ(ba, 4 * kAlign);
}

}  // namespace
}  // namespace leasehold
