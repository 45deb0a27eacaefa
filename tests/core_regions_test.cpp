// Shared cache regions inside the coordinator's core, with a fake clock:
// fill, wait, ready, detach, LRU eviction under the policy, a filler that
// dies, drop refused while attached, and the refusals.
#include <gtest/gtest.h>

#include "coordinator/occupancy_policy.h"
#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

constexpr uint64_t MiB = 1ull << 20;

const proto::RegionT* region(const proto::RegionListT& list, const std::string& name) {
  for (const auto& r : list.regions) {
    if (r->name == name) return r.get();
  }
  return nullptr;
}

class Regions : public ::testing::Test {
 protected:
  explicit Regions(std::unique_ptr<SchedulingPolicy> policy = nullptr)
      : d(job_options(), 64 * MiB, std::move(policy)) {}

  // Attaches, fills and marks ready `name` for `a`; returns its offset.
  uint64_t fill(const FakeAgent& a, const std::string& name, uint64_t bytes) {
    Effects e = d.attach(a, name, bytes, true);
    const auto* g = region_grant(e, a);
    EXPECT_TRUE(g && g->fill) << errors(e);
    if (!g) return 0;
    EXPECT_FALSE(messages(d.region_ready(a, name), proto::Body::Ack, a.rid).empty());
    return g->region->offset;
  }
  const proto::RegionT* find(const std::string& name) {
    list = d.regions();
    return region(list, name);
  }

  CoreDriver d;
  proto::RegionListT list;
};

TEST_F(Regions, FirstAttacherFillsOthersWaitUntilReadyAndCountAsHits) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent b = d.register_agent("b", 102);
  FakeAgent c = d.register_agent("c", 103);

  Effects ea = d.attach(a, "dataset/x", 10 * MiB, true);
  const auto* ga = region_grant(ea, a);
  ASSERT_TRUE(ga) << errors(ea);
  EXPECT_TRUE(ga->fill);
  EXPECT_EQ(ga->region->size, 10 * MiB);
  // Placed at the high end of the pool, like other long-lived memory.
  EXPECT_EQ(ga->region->offset, 54 * MiB);

  // While a fills it, b and c wait: no answer yet.
  Effects eb = d.attach(b, "dataset/x", 10 * MiB, true);
  Effects ec = d.attach(c, "dataset/x", 0, false);
  EXPECT_TRUE(eb.messages.empty()) << errors(eb);
  EXPECT_TRUE(ec.messages.empty()) << errors(ec);
  EXPECT_EQ(find("dataset/x")->state, proto::RegionState::Filling);
  EXPECT_EQ(find("dataset/x")->filler, "a");

  // Ready: both waiters get the region, none of them fills it.
  Effects ready = d.region_ready(a, "dataset/x");
  EXPECT_FALSE(messages(ready, proto::Body::Ack, a.rid).empty());
  const auto* gb = region_grant(ready, b);
  const auto* gc = region_grant(ready, c);
  ASSERT_TRUE(gb && gc);
  EXPECT_FALSE(gb->fill);
  EXPECT_FALSE(gc->fill);
  EXPECT_EQ(gb->region->offset, ga->region->offset);

  const auto* r = find("dataset/x");
  EXPECT_EQ(r->state, proto::RegionState::Ready);
  EXPECT_EQ(r->refcount, 3u);
  EXPECT_EQ(r->misses, 1u);
  EXPECT_EQ(r->hits, 2u);
  EXPECT_EQ(list.hits, 2u);
  EXPECT_EQ(list.misses, 1u);

  // A later attach finds it ready at once.
  Effects again = d.attach(b, "dataset/x", 10 * MiB, true);
  ASSERT_TRUE(region_grant(again, b));
  EXPECT_FALSE(region_grant(again, b)->fill);
  EXPECT_EQ(find("dataset/x")->refcount, 4u);
}

TEST_F(Regions, DetachKeepsTheRegionAsACacheAndTheLeastRecentlyUsedGoesFirst) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent w = d.register_agent("w", 102, {}, nullptr, /*takes_jobs=*/false);
  // "new" at the top of the pool, "old" right below it: evicting "old"
  // leaves 48 MiB in one piece.
  fill(a, "new", 16 * MiB);
  d.advance(std::chrono::milliseconds(10));
  fill(a, "old", 16 * MiB);
  d.advance(std::chrono::milliseconds(10));
  EXPECT_FALSE(messages(d.detach(a, "old"), proto::Body::Ack, a.rid).empty());
  d.advance(std::chrono::milliseconds(10));
  EXPECT_FALSE(messages(d.detach(a, "new"), proto::Body::Ack, a.rid).empty());
  // Unattached, both stay resident.
  EXPECT_EQ(find("old")->state, proto::RegionState::Ready);
  EXPECT_EQ(find("old")->refcount, 0u);
  EXPECT_EQ(find("new")->state, proto::RegionState::Ready);

  // 32 MiB free: a lease of 40 MiB has to wait, and the least recently used
  // idle region gives way so it can be granted.
  Effects e = d.lease(w, 40 * MiB, 5000);
  EXPECT_NE(granted_lease(e, w), 0u) << errors(e);
  EXPECT_EQ(find("old")->state, proto::RegionState::Evicted);
  EXPECT_EQ(find("old")->evictions, 1u);
  EXPECT_EQ(find("new")->state, proto::RegionState::Ready);
  EXPECT_EQ(list.evictions, 1u);

  // An evicted region is refilled by the next attach that may create it.
  Effects gone = d.attach(a, "old", 0, false);
  EXPECT_EQ(error_code(gone, a.rid), ErrorCode::NoSuchRegion);
  EXPECT_NE(errors(gone).find("evicted"), std::string::npos) << errors(gone);
}

TEST_F(Regions, AnAttachedRegionIsNeverEvicted) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent w = d.register_agent("w", 102, {}, nullptr, false);
  fill(a, "pinned", 32 * MiB);
  Effects e = d.lease(w, 40 * MiB, 1000);
  EXPECT_EQ(granted_lease(e, w), 0u);
  d.advance(std::chrono::milliseconds(1001));
  d.heartbeat(a);
  d.heartbeat(w);
  Effects t = d.tick();
  EXPECT_EQ(error_code(t, w.rid), ErrorCode::Timeout) << errors(t);
  EXPECT_EQ(find("pinned")->state, proto::RegionState::Ready);
  EXPECT_EQ(find("pinned")->refcount, 1u);
}

TEST_F(Regions, AFillerThatDiesHandsTheRegionToAWaiterThatMayCreateIt) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent b = d.register_agent("b", 102);
  FakeAgent c = d.register_agent("c", 103);
  ASSERT_TRUE(region_grant(d.attach(a, "r", 8 * MiB, true), a));
  EXPECT_TRUE(d.attach(c, "r", 0, false).messages.empty());  // waits, may not create
  EXPECT_TRUE(d.attach(b, "r", 8 * MiB, true).messages.empty());

  // a is killed before it marks the region ready.
  d.gone.insert(101);
  d.advance(std::chrono::milliseconds(2500));
  d.heartbeat(b);
  d.heartbeat(c);
  Effects t = d.tick();
  EXPECT_EQ(d.core().agents().count("a"), 0u);
  // c could not fill it: it learns why; b fills it again.
  EXPECT_EQ(error_code(t, c.rid), ErrorCode::NoSuchRegion) << errors(t);
  EXPECT_NE(errors(t).find("discarded"), std::string::npos) << errors(t);
  const auto* gb = region_grant(t, b);
  ASSERT_TRUE(gb) << errors(t);
  EXPECT_TRUE(gb->fill);
  const auto* r = find("r");
  EXPECT_EQ(r->state, proto::RegionState::Filling);
  EXPECT_EQ(r->filler, "b");
  EXPECT_EQ(r->misses, 2u);
  // Only the new copy's memory is leased: a's was freed with its leases.
  uint64_t leased = 0;
  for (const auto& [id, l] : d.core().device(0).leases.leases()) leased += l.size;
  EXPECT_EQ(leased, 8 * MiB);
}

TEST_F(Regions, ASilentFillerKeepsItsRegionFencedUntilItsProcessIsGone) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent b = d.register_agent("b", 102);
  d.heartbeat(a);  // past its first-heartbeat grace
  ASSERT_TRUE(region_grant(d.attach(a, "r", 8 * MiB, true), a));
  // a is stopped but lives: once continued it may write into the region.
  d.stopped.insert(101);
  d.advance(std::chrono::milliseconds(2500));
  d.heartbeat(b);
  d.tick();
  EXPECT_EQ(d.core().agents().count("a"), 0u);
  EXPECT_EQ(find("r")->state, proto::RegionState::Evicted);
  bool fenced = false;
  for (const auto& [id, l] : d.core().device(0).leases.leases())
    fenced |= l.owner == LeaseOwner::fenced("a");
  EXPECT_TRUE(fenced);
  // Once its process is gone the memory goes back.
  d.gone.insert(101);
  d.advance(std::chrono::milliseconds(500));
  d.heartbeat(b);
  d.tick();
  EXPECT_TRUE(d.core().device(0).leases.leases().empty());
}

TEST_F(Regions, AFillerThatDetachesBeforeReadyDiscardsIt) {
  FakeAgent a = d.register_agent("a", 101);
  ASSERT_TRUE(region_grant(d.attach(a, "r", 8 * MiB, true), a));
  EXPECT_FALSE(messages(d.detach(a, "r"), proto::Body::Ack, a.rid).empty());
  EXPECT_EQ(find("r")->state, proto::RegionState::Evicted);
  EXPECT_TRUE(d.core().device(0).leases.leases().empty());
}

TEST_F(Regions, DropIsRefusedWhileAttachedOrFillingAndFreesTheMemoryAfter) {
  FakeAgent a = d.register_agent("a", 101);
  ASSERT_TRUE(region_grant(d.attach(a, "r", 8 * MiB, true), a));
  Effects filling = d.drop_region("r");
  EXPECT_EQ(error_code(filling, "client"), ErrorCode::RegionBusy);
  d.region_ready(a, "r");
  Effects attached = d.drop_region("r");
  EXPECT_EQ(error_code(attached, "client"), ErrorCode::RegionBusy);
  EXPECT_NE(errors(attached).find("'a'"), std::string::npos) << errors(attached);
  EXPECT_EQ(find("r")->state, proto::RegionState::Ready);

  d.detach(a, "r");
  Effects dropped = d.drop_region("r");
  EXPECT_FALSE(messages(dropped, proto::Body::Ack, "client").empty()) << errors(dropped);
  EXPECT_EQ(find("r"), nullptr);
  EXPECT_TRUE(d.core().device(0).leases.leases().empty());
  EXPECT_EQ(error_code(d.drop_region("r"), "client"), ErrorCode::NoSuchRegion);
}

TEST_F(Regions, BadAttachesAreRefusedAndChangeNothing) {
  FakeAgent a = d.register_agent("a", 101);
  fill(a, "r", 8 * MiB);
  EXPECT_EQ(error_code(d.attach(a, "", 8 * MiB, true), a.rid), ErrorCode::InvalidArgument);
  EXPECT_EQ(error_code(d.attach(a, "/abs", 8 * MiB, true), a.rid), ErrorCode::InvalidArgument);
  EXPECT_EQ(error_code(d.attach(a, "a b", 8 * MiB, true), a.rid), ErrorCode::InvalidArgument);
  EXPECT_EQ(error_code(d.attach(a, "x", 0, true), a.rid), ErrorCode::InvalidArgument);
  EXPECT_EQ(error_code(d.attach(a, "x", 65 * MiB, true), a.rid), ErrorCode::TooLarge);
  EXPECT_EQ(error_code(d.attach(a, "r", 9 * MiB, true), a.rid), ErrorCode::InvalidArgument);
  EXPECT_EQ(error_code(d.attach(a, "none", 0, false), a.rid), ErrorCode::NoSuchRegion);
  // Replacing a region that is attached is refused.
  EXPECT_EQ(error_code(d.attach(a, "r", 8 * MiB, true, -1, true), a.rid), ErrorCode::RegionBusy);
  // Ready from an agent that is not filling it, detach without an attachment.
  FakeAgent b = d.register_agent("b", 102);
  EXPECT_EQ(error_code(d.region_ready(b, "r"), b.rid), ErrorCode::NotOwner);
  EXPECT_EQ(error_code(d.detach(b, "r"), b.rid), ErrorCode::NoSuchRegion);
  // An unregistered sender.
  FakeAgent stranger{"stranger", 999, "rid-x", 0};
  EXPECT_EQ(error_code(d.attach(stranger, "r", 8 * MiB, true), stranger.rid),
            ErrorCode::UnknownSender);

  const auto* r = find("r");
  EXPECT_EQ(r->state, proto::RegionState::Ready);
  EXPECT_EQ(r->refcount, 1u);
  EXPECT_EQ(list.regions.size(), 1u);
}

TEST_F(Regions, AWaiterPastItsDeadlineGetsTimeout) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent b = d.register_agent("b", 102);
  ASSERT_TRUE(region_grant(d.attach(a, "r", 8 * MiB, true), a));
  EXPECT_TRUE(d.attach(b, "r", 8 * MiB, true, 300).messages.empty());
  d.advance(std::chrono::milliseconds(301));
  Effects t = d.tick();
  EXPECT_EQ(error_code(t, b.rid), ErrorCode::Timeout) << errors(t);
  EXPECT_NE(errors(t).find("'a' fills it"), std::string::npos) << errors(t);
  // a is still filling, and marking it ready works.
  EXPECT_FALSE(messages(d.region_ready(a, "r"), proto::Body::Ack, a.rid).empty());
}

class RegionsUnderOccupancy : public Regions {
 protected:
  RegionsUnderOccupancy() : Regions(std::make_unique<OccupancyPolicy>(OccupancyOptions{})) {}
};

TEST_F(RegionsUnderOccupancy, AnIdleRegionCountsForAdmissionAndGivesWayToTheJobsLeases) {
  FakeAgent a = d.register_agent("a", 101);
  fill(a, "cache", 40 * MiB);
  d.detach(a, "cache");
  // 24 MiB free: a job guaranteed 32 MiB starts, counting the idle region,
  // which goes at once (the job could otherwise pin it by attaching it).
  uint64_t id = 0;
  Effects s = d.submit(id, [](proto::JobSpecT& j) { j.memory_budget = "32MiB"; });
  ASSERT_EQ(assigned(s, a).size(), 1u) << d.job(id).waiting_for;
  EXPECT_EQ(find("cache")->state, proto::RegionState::Evicted);
  d.heartbeat(a, {{id, 1, proto::JobPhase::Running}});
  EXPECT_NE(granted_lease(d.lease(a, 16 * MiB, 5000), a), 0u);
  Effects e = d.lease(a, 16 * MiB, 5000);
  EXPECT_NE(granted_lease(e, a), 0u) << errors(e);
}

TEST_F(RegionsUnderOccupancy, NothingIsEvictedForWhatCouldNotBePlacedAnyway) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent w = d.register_agent("w", 102, {}, nullptr, false);
  fill(a, "one", 16 * MiB);
  d.detach(a, "one");
  fill(a, "pinned", 16 * MiB);
  // A region over the low watermark even with "one" gone: refused, "one" stays.
  Effects big = d.attach(a, "big", 40 * MiB, true);
  EXPECT_EQ(error_code(big, a.rid), ErrorCode::NoSpace) << errors(big);
  EXPECT_EQ(find("one")->state, proto::RegionState::Ready);
  // A lease that cannot fit even with every idle region gone waits without
  // evicting anything.
  Effects e = d.lease(w, 60 * MiB, 5000);
  EXPECT_EQ(granted_lease(e, w), 0u);
  EXPECT_EQ(find("one")->state, proto::RegionState::Ready);
}

TEST_F(Regions, ReplacingKeepsTheOldContentsUnlessTheNewHaveAPlace) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent w = d.register_agent("w", 102, {}, nullptr, false);
  fill(a, "params/p", 8 * MiB);
  d.detach(a, "params/p");
  EXPECT_EQ(error_code(d.attach(a, "params/p", 8 * MiB, false, -1, true), a.rid),
            ErrorCode::InvalidArgument);
  // While a lease waits for memory (more than evicting could give) no cache
  // is placed: the old contents stay.
  fill(a, "held", 40 * MiB);
  EXPECT_EQ(granted_lease(d.lease(w, 30 * MiB, 5000), w), 0u);
  Effects refused = d.attach(a, "params/p", 12 * MiB, true, -1, true);
  EXPECT_EQ(error_code(refused, a.rid), ErrorCode::NoSpace) << errors(refused);
  EXPECT_EQ(find("params/p")->state, proto::RegionState::Ready);
  EXPECT_EQ(find("params/p")->size, 8 * MiB);
}

TEST_F(RegionsUnderOccupancy, ANewRegionStaysBelowTheLowWatermarkEvictingIdleOnesFirst) {
  FakeAgent a = d.register_agent("a", 101);
  // 80% of 64 MiB is 51.2 MiB.
  fill(a, "one", 20 * MiB);
  d.detach(a, "one");
  d.advance(std::chrono::milliseconds(10));
  fill(a, "two", 20 * MiB);
  // A third of 20 MiB would pass the watermark: "one" (idle) goes for it.
  Effects e = d.attach(a, "three", 20 * MiB, true);
  ASSERT_TRUE(region_grant(e, a)) << errors(e);
  EXPECT_EQ(find("one")->state, proto::RegionState::Evicted);
  EXPECT_EQ(find("two")->state, proto::RegionState::Ready);
  // With nothing idle left, a fourth is refused rather than making anyone shrink.
  d.region_ready(a, "three");
  Effects refused = d.attach(a, "four", 16 * MiB, true);
  EXPECT_EQ(error_code(refused, a.rid), ErrorCode::NoSpace);
  EXPECT_NE(errors(refused).find("low watermark"), std::string::npos) << errors(refused);
  EXPECT_EQ(find("four"), nullptr);
}

TEST_F(RegionsUnderOccupancy, AttachingAReadyRegionNeedsNoRoom) {
  FakeAgent a = d.register_agent("a", 101);
  FakeAgent b = d.register_agent("b", 102);
  fill(a, "big", 50 * MiB);
  Effects e = d.attach(b, "big", 50 * MiB, true);
  ASSERT_TRUE(region_grant(e, b)) << errors(e);
  EXPECT_FALSE(region_grant(e, b)->fill);
}

}  // namespace
}  // namespace leasehold::testing
