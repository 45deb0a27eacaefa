// The occupancy policy inside the coordinator's core, with a fake clock:
// admission order and reasons, watermark transitions, whom to shrink,
// Shrink deadlines, priorities, and the protocol's refusals.
#include <gtest/gtest.h>

#include "coordinator/occupancy_policy.h"
#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

constexpr uint64_t MiB = 1ull << 20;

class OccupancyTest : public ::testing::Test {
 protected:
  OccupancyTest()
      : d(options(), 100 * MiB, std::make_unique<OccupancyPolicy>(OccupancyOptions{})) {}

  static CoreOptions options() {
    CoreOptions o = job_options();
    o.shrink_timeout = std::chrono::milliseconds(3000);
    return o;
  }

  // A job with a guaranteed share of `min` MiB, growing up to `budget` MiB.
  uint64_t submit(int min, int budget, int priority = 0) {
    uint64_t id = 0;
    d.submit(id, [&](proto::JobSpecT& s) {
      s.memory_min = std::to_string(min) + "MiB";
      s.memory_budget = std::to_string(budget) + "MiB";
      s.priority = priority;
    });
    return id;
  }

  // The agents heart-beat (listing the jobs they run) while `ms` pass.
  void pass(int ms) {
    for (int t = 0; t < ms; t += 500) {
      d.advance(std::chrono::milliseconds(500));
      for (const auto& a : agents) {
        std::vector<Listed> jobs;
        if (uint64_t job = running_on(a)) jobs.push_back({job, 1, proto::JobPhase::Running});
        d.heartbeat(a, jobs);
      }
      last_tick = d.tick();
    }
  }

  uint64_t running_on(const FakeAgent& a) {
    auto it = d.core().agents().find(a.name);
    return it == d.core().agents().end() ? 0 : it->second.job_id;
  }

  FakeAgent add_agent(const std::string& name, int pid) {
    agents.push_back(d.register_agent(name, pid));
    return agents.back();
  }

  // Leases `mib` MiB for `a`: the lease id, or 0 (refused or waiting).
  uint64_t lease(const FakeAgent& a, int mib, int wait_ms = 0, Effects* out = nullptr,
                 bool needed = false) {
    Effects e = d.lease(a, mib * MiB, wait_ms, needed);
    if (out) *out = e;
    return granted_lease(e, a);
  }

  proto::StatusReplyT status() { return d.status_reply(); }

  CoreDriver d;
  std::vector<FakeAgent> agents;
  Effects last_tick;
};

TEST_F(OccupancyTest, JobsStartOnlyWhenTheirGuaranteedShareFitsAndSayWhyTheyWait) {
  FakeAgent a1 = add_agent("a1", 101);
  FakeAgent a2 = add_agent("a2", 102);
  uint64_t j1 = submit(60, 60);
  uint64_t j2 = submit(60, 60);
  EXPECT_EQ(d.job(j1).state, JobState::Running);
  EXPECT_EQ(d.job(j2).state, JobState::Queued);
  // Nothing is leased yet, but j1's share is reserved.
  EXPECT_EQ(d.job(j2).waiting_for,
            "waiting for 20.00 MiB; 40.00 MiB free, 0 B reclaimable (guaranteed share 60.00 MiB)");
  uint64_t j3 = submit(10, 10);
  EXPECT_EQ(d.job(j3).state, JobState::Queued) << "a smaller job does not overtake";
  EXPECT_EQ(d.job(j3).waiting_for, JobTable::kBehind);

  pass(4000);
  ASSERT_EQ(d.job(j2).state, JobState::Queued);
  d.update(a1, j1, 1, "succeeded");
  EXPECT_EQ(d.job(j2).state, JobState::Running);
  EXPECT_EQ(d.job(j2).memory_wait_ms, 4000u) << "time spent waiting for memory";
  EXPECT_EQ(d.job(j2).waiting_for, "");
  EXPECT_EQ(d.job(j3).state, JobState::Running) << "10 MiB fit beside j2";
}

TEST_F(OccupancyTest, GrowthPastTheGuaranteedShareStopsAtTheLowWatermark) {
  FakeAgent a1 = add_agent("a1", 101);
  FakeAgent a2 = add_agent("a2", 102);
  uint64_t j1 = submit(20, 95);
  uint64_t j2 = submit(10, 10);
  ASSERT_EQ(running_on(a1), j1);
  ASSERT_EQ(running_on(a2), j2);
  EXPECT_NE(lease(a1, 20), 0u) << "within the guaranteed share";
  // Occupancy with j2's reservation: 20 + 10 + 40 = 70% <= 80%.
  EXPECT_NE(lease(a1, 40), 0u);
  auto s = status();
  EXPECT_DOUBLE_EQ(s.devices[0]->occupancy->occupancy, 0.60);
  EXPECT_DOUBLE_EQ(s.devices[0]->occupancy->occupancy_future, 0.70);
  EXPECT_EQ(s.devices[0]->occupancy->reserved_bytes, 10 * MiB);
  EXPECT_EQ(s.devices[0]->occupancy->reclaimable_bytes, 40 * MiB);
  EXPECT_EQ(s.devices[0]->occupancy->policy, "occupancy");
  // 70 + 12 = 82% > 80%: held back, and refused at once when it may not wait.
  Effects e;
  EXPECT_EQ(lease(a1, 12, 0, &e), 0u);
  EXPECT_NE(errors(e).find("held back by the scheduling policy"), std::string::npos) << errors(e);
  EXPECT_NE(lease(a1, 10), 0u) << "70 + 10 = 80% is still allowed";
  // j2's guaranteed lease goes in between the watermarks.
  EXPECT_NE(lease(a2, 10), 0u);
  EXPECT_DOUBLE_EQ(status().devices[0]->occupancy->occupancy, 0.80);
  EXPECT_EQ(lease(a1, 1), 0u) << "no growth at the low watermark";
}

// Growth a job cannot do without (its agent has nothing left to spill, as a
// convolution's workspace during evaluation) is not held at the low
// watermark: refusing it would fail the job with the memory free.
TEST_F(OccupancyTest, NeededGrowthGoesUpToTheHighWatermarkAndTakesBackOthersGrowth) {
  FakeAgent a1 = add_agent("a1", 101);
  FakeAgent a2 = add_agent("a2", 102);
  uint64_t j1 = submit(30, 80);
  uint64_t j2 = submit(30, 80);
  ASSERT_EQ(running_on(a1), j1);
  ASSERT_EQ(running_on(a2), j2);
  ASSERT_NE(lease(a1, 20), 0u);
  ASSERT_NE(lease(a2, 20), 0u);
  // 40 used + a2's 10 reserved: a1 growing by 32 makes 82% > 80%.
  Effects e;
  EXPECT_EQ(lease(a1, 32, 0, &e), 0u) << "speculative growth stops at the low watermark";
  EXPECT_NE(errors(e).find("held back by the scheduling policy"), std::string::npos) << errors(e);
  uint64_t need1 = lease(a1, 32, 0, nullptr, /*needed=*/true);
  EXPECT_NE(need1, 0u) << "needed growth: 82% <= 95%";
  EXPECT_DOUBLE_EQ(status().devices[0]->occupancy->occupancy_future, 0.82);
  // Above the high watermark needed growth waits; a1's own growth is not
  // asked back for it, and a2 holds nothing past its share: no Shrink.
  Effects own;
  EXPECT_EQ(lease(a1, 25, 1000, &own, /*needed=*/true), 0u) << "72 + 10 reserved + 25 > 95";
  EXPECT_EQ(shrink_of(own, a1), nullptr);
  EXPECT_EQ(shrink_of(own, a2), nullptr);
  d.advance(std::chrono::milliseconds(1000));
  EXPECT_NE(errors(d.tick()).find("was not granted before its deadline"), std::string::npos);
  // a2's need may have a1's growth back: a1 can spill, a2 cannot.
  Effects w;
  EXPECT_EQ(lease(a2, 25, 5000, &w, /*needed=*/true), 0u) << "72 + 25 = 97% > 95%";
  const proto::ShrinkT* s = shrink_of(w, a1);
  ASSERT_NE(s, nullptr) << "others' growth comes back for a need";
  EXPECT_EQ(s->bytes, 2 * MiB) << "what brings the pool back to the high watermark";
  EXPECT_NE(s->reason.find("agent 'a2' needing 25.00 MiB"), std::string::npos) << s->reason;
  // a1 gives its growth back: a2's need is granted.
  Effects r = d.release(a1, need1);
  EXPECT_NE(granted_lease(r, a2), 0u) << errors(r);
  EXPECT_TRUE(errors(d.shrink_done(a1, s->id, 32 * MiB)).empty());
}

// A need is not served by higher-priority jobs' growth, and does not hold
// up guaranteed leases behind it.
TEST_F(OccupancyTest, NeededGrowthDoesNotTakeHigherPriorityGrowth) {
  FakeAgent a1 = add_agent("a1", 101);
  FakeAgent a2 = add_agent("a2", 102);
  FakeAgent a3 = add_agent("a3", 103);
  uint64_t hi = submit(10, 60, /*priority=*/5);
  uint64_t lo = submit(10, 60, /*priority=*/0);
  uint64_t mid = submit(20, 60, /*priority=*/1);
  ASSERT_EQ(running_on(a1), hi);
  ASSERT_EQ(running_on(a2), lo);
  ASSERT_EQ(running_on(a3), mid);
  ASSERT_NE(lease(a1, 10), 0u);
  ASSERT_NE(lease(a1, 30, 0, nullptr, /*needed=*/true), 0u);  // hi: 30 past its share
  ASSERT_NE(lease(a2, 10), 0u);
  ASSERT_NE(lease(a3, 10), 0u);  // 60 used, a3's 10 reserved
  // lo's need (70 + 30 = 100% > 95%) may not take hi's growth: no Shrink.
  Effects e;
  EXPECT_EQ(lease(a2, 30, 5000, &e, /*needed=*/true), 0u);
  EXPECT_EQ(shrink_of(e, a1), nullptr) << "a higher-priority job's growth is not taken";
  // mid's guaranteed lease is granted although lo's need waits before it.
  EXPECT_NE(lease(a3, 10), 0u);
}

// The policy alone, on a pool view built by hand.
TEST(OccupancyPolicyRules, NeedsWaitForGuaranteesAndNeverAskTheirOwnAgent) {
  OccupancyPolicy policy(OccupancyOptions{});
  PoolView pool;
  pool.pool_size = 100 * MiB;
  pool.used = 70 * MiB;
  pool.largest_free = 30 * MiB;
  auto agent = [](const char* name, uint64_t job, uint64_t guaranteed, uint64_t leased) {
    AgentShare a;
    a.name = name;
    a.job_id = job;
    a.guaranteed = guaranteed * MiB;
    a.leased = leased * MiB;
    a.shrinkable = true;
    return a;
  };
  pool.agents = {agent("a1", 1, 10, 40), agent("a2", 2, 40, 20), agent("a3", 3, 10, 10)};
  auto request = [](const char* owner, uint64_t mib, bool needed) {
    PendingRequest r;
    r.owner = LeaseOwner::agent(owner);
    r.size = mib * MiB;
    r.needed = needed;
    return r;
  };
  // a3's need (70 + 20 reserved - 0 + 5 = 95%) fits the high watermark...
  EXPECT_TRUE(policy.may_grant(request("a3", 5, true), pool));
  // ...but not while a2's guaranteed request waits.
  pool.waiting = {request("a2", 20, false)};
  EXPECT_FALSE(policy.may_grant(request("a3", 5, true), pool));
  // a2's guaranteed 5 above the high watermark: a1, 37 past its share, is
  // asked for what brings the pool back to it.
  pool.used = 92 * MiB;
  pool.agents[0].leased = 47 * MiB;
  pool.agents[1].leased = 35 * MiB;
  pool.waiting = {request("a2", 5, false), request("a3", 10, true)};
  auto asked = policy.shrinks(pool);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].agent, "a1");
  EXPECT_EQ(asked[0].bytes, 2 * MiB) << "92 + 5 = 97%: back to 95%";
  // With only needs waiting, a need never asks its own agent.
  pool.waiting = {request("a1", 10, true)};
  EXPECT_TRUE(policy.shrinks(pool).empty()) << "a1's own growth is not asked for a1's need";
  // Nothing waiting, but guaranteed grants took the pool past the high
  // watermark: growth is asked back down to it.
  pool.waiting.clear();
  pool.used = 98 * MiB;
  asked = policy.shrinks(pool);
  ASSERT_EQ(asked.size(), 1u);
  EXPECT_EQ(asked[0].agent, "a1");
  EXPECT_EQ(asked[0].bytes, 3 * MiB);
}

TEST_F(OccupancyTest, AboveTheHighWatermarkTheLowestPriorityMostOverShrinksFirst) {
  FakeAgent a1 = add_agent("a1", 101);
  FakeAgent a2 = add_agent("a2", 102);
  FakeAgent a3 = add_agent("a3", 103);
  uint64_t j1 = submit(10, 60, /*priority=*/0);
  uint64_t j2 = submit(10, 60, /*priority=*/1);
  ASSERT_EQ(running_on(a1), j1);
  ASSERT_EQ(running_on(a2), j2);
  uint64_t l1a = lease(a1, 10), l1b = lease(a1, 30);
  ASSERT_NE(l1a, 0u);
  ASSERT_NE(l1b, 0u);
  ASSERT_NE(lease(a2, 10), 0u);
  ASSERT_NE(lease(a2, 20), 0u);  // 40 + 30 = 70%
  // 30 free plus j1's 30 reclaimable (j2 has a higher priority): 40 fit.
  uint64_t j3 = submit(40, 40, /*priority=*/0);
  ASSERT_EQ(running_on(a3), j3);
  ASSERT_NE(lease(a3, 20, 5000), 0u) << "90% <= 95%";
  // 90 + 10 = 100% > 95%: j3 waits while j1 and j2 hold 50 MiB past their shares.
  Effects e;
  EXPECT_EQ(lease(a3, 10, 5000, &e), 0u);
  const proto::ShrinkT* s = shrink_of(e, a1);
  ASSERT_NE(s, nullptr) << "the lowest priority shrinks first";
  EXPECT_EQ(shrink_of(e, a2), nullptr);
  EXPECT_EQ(s->bytes, 5 * MiB) << "what brings the pool back to the high watermark";
  EXPECT_EQ(s->job_id, j1);
  EXPECT_EQ(s->agent, "a1");
  ASSERT_EQ(e.notices.size(), 1u);
  EXPECT_EQ(e.notices[0].topic, "shrink.a1.");
  auto st = status();
  EXPECT_EQ(st.devices[0]->occupancy->shrinks_pending, 1u);
  for (const auto& a : st.agents) {
    if (a->name == "a1") {
      EXPECT_EQ(a->shrink_pending_bytes, 5 * MiB);
      EXPECT_EQ(a->guaranteed_bytes, 10 * MiB);
      EXPECT_EQ(a->leased_bytes, 40 * MiB);
    }
  }
  // Opportunistic growth waits while j3 waits, even below the low watermark.
  EXPECT_EQ(lease(a2, 1), 0u);
  // a1 gives a lease back and answers: j3 gets its memory.
  Effects r = d.release(a1, l1b);
  EXPECT_NE(granted_lease(r, a3), 0u);
  Effects done = d.shrink_done(a1, s->id, 30 * MiB);
  EXPECT_TRUE(errors(done).empty()) << errors(done);
  EXPECT_EQ(d.job(j1).shrinks, 1u);
  EXPECT_EQ(d.job(j1).shrunk_bytes, 30 * MiB);
  EXPECT_TRUE(done.store_puts.count(j1)) << "the job record keeps it";
  EXPECT_EQ(status().devices[0]->occupancy->shrinks_pending, 0u);
}

TEST_F(OccupancyTest, AnAgentThatDoesNotAnswerIsSkippedThenTreatedAsDead) {
  FakeAgent a1 = add_agent("a1", 101);
  FakeAgent a2 = add_agent("a2", 102);
  FakeAgent a3 = add_agent("a3", 103);
  uint64_t j1 = submit(10, 60);
  uint64_t j2 = submit(10, 60);
  ASSERT_NE(lease(a1, 10), 0u);
  ASSERT_NE(lease(a1, 40), 0u);
  ASSERT_NE(lease(a2, 10), 0u);
  ASSERT_NE(lease(a2, 10), 0u);  // 70%: j1 30 over, j2 10 over
  uint64_t j3 = submit(30, 30);
  ASSERT_EQ(running_on(a3), j3);
  ASSERT_NE(lease(a3, 25, 20000), 0u);  // 95%
  Effects e;
  ASSERT_EQ(lease(a3, 5, 20000, &e), 0u);
  const proto::ShrinkT* s1 = shrink_of(e, a1);
  ASSERT_NE(s1, nullptr) << "the most over its share first";
  EXPECT_EQ(s1->bytes, 5 * MiB);

  // a1 never answers: after the deadline it is skipped and a2 is asked.
  pass(2500);
  EXPECT_EQ(shrink_of(last_tick, a2), nullptr);
  pass(500);
  bool skipped = false;
  for (const auto& n : last_tick.notices) {
    if (n.topic == "shrink.a1." && n.body.type == proto::Body::ShrinkDone) skipped = true;
  }
  EXPECT_TRUE(skipped) << "the missed deadline is published";
  const proto::ShrinkT* s2 = shrink_of(last_tick, a2);
  ASSERT_NE(s2, nullptr);
  EXPECT_EQ(s2->bytes, 5 * MiB);
  // a2 gives a 10 MiB lease back (then answers): j3's request is granted.
  uint64_t l2 = 0;
  for (const auto& [id, rec] : d.core().device(0).leases.leases()) {
    if (rec.owner == LeaseOwner::agent("a2") && rec.size == 10 * MiB) l2 = id;
  }
  Effects r = d.release(a2, l2);
  EXPECT_NE(granted_lease(r, a3), 0u) << errors(r);
  Effects done = d.shrink_done(a2, s2->id, 10 * MiB);
  EXPECT_TRUE(errors(done).empty()) << errors(done);
  EXPECT_EQ(d.job(j2).shrunk_bytes, 10 * MiB);

  // Still silent after twice the timeout: dropped like an agent that stopped
  // heart-beating (its process lives, so its leases are fenced) and its job
  // waits to be requeued; the coordinator goes on answering.
  pass(3000);
  EXPECT_EQ(d.core().agents().count("a1"), 0u);
  EXPECT_EQ(d.job(j1).state, JobState::Running);
  EXPECT_TRUE(d.job(j1).orphaned_since.has_value());
  EXPECT_EQ(status().agents.size(), 2u);
  agents.erase(agents.begin());
  pass(6000);  // recovery_grace
  EXPECT_EQ(d.job(j1).state, JobState::Queued);
  EXPECT_NE(d.job(j1).reason.find("fell silent"), std::string::npos) << d.job(j1).reason;
  EXPECT_EQ(d.job(j2).state, JobState::Running);
}

TEST_F(OccupancyTest, AHigherPriorityJobReclaimsLowerPriorityGrowthButNotTheReverse) {
  FakeAgent a1 = add_agent("a1", 101);
  FakeAgent a2 = add_agent("a2", 102);
  uint64_t hi = submit(20, 80, /*priority=*/5);
  ASSERT_EQ(running_on(a1), hi);
  ASSERT_NE(lease(a1, 20), 0u);
  ASSERT_NE(lease(a1, 50), 0u);  // 70%: 50 MiB past its share
  // A lower-priority job cannot have it: it waits.
  uint64_t lo = submit(40, 40, /*priority=*/0);
  EXPECT_EQ(d.job(lo).state, JobState::Queued);
  EXPECT_EQ(d.job(lo).waiting_for,
            "waiting for 10.00 MiB; 30.00 MiB free, 0 B reclaimable (guaranteed share 40.00 MiB)");
  // Cancel that, and run the other way round.
  d.cancel(lo);
  d.update(a1, hi, 1, "succeeded");
  for (const auto& [id, rec] :
       std::map<uint64_t, LeaseRecord>(d.core().device(0).leases.leases())) {
    d.release(a1, id);
  }
  uint64_t low = submit(20, 80, /*priority=*/0);
  ASSERT_EQ(d.job(low).state, JobState::Running);
  FakeAgent runner = running_on(a1) == low ? a1 : a2;
  FakeAgent other = running_on(a1) == low ? a2 : a1;
  ASSERT_NE(lease(runner, 20), 0u);
  ASSERT_NE(lease(runner, 50), 0u);
  uint64_t high = submit(40, 40, /*priority=*/5);
  EXPECT_EQ(d.job(high).state, JobState::Running) << "30 free + 50 reclaimable of lower priority";
  EXPECT_EQ(running_on(other), high);
  // It never takes a guaranteed share away: only what is past it.
  ASSERT_NE(lease(other, 25, 5000), 0u);  // 95%
  Effects e;
  EXPECT_EQ(lease(other, 15, 5000, &e), 0u);
  const proto::ShrinkT* s = shrink_of(e, runner);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->bytes, 15 * MiB);
  EXPECT_LE(s->bytes, 50 * MiB);
}

TEST_F(OccupancyTest, RequestsThatCanNeverFitOrWaitTooLongStillFailClearly) {
  FakeAgent a1 = add_agent("a1", 101);
  uint64_t j1 = submit(50, 50);
  ASSERT_EQ(running_on(a1), j1);
  Effects e;
  EXPECT_EQ(lease(a1, 101, 5000, &e), 0u);
  EXPECT_NE(errors(e).find("can never fit"), std::string::npos) << errors(e);
  // Past its share, waiting: fails with Timeout at its deadline.
  ASSERT_NE(lease(a1, 50), 0u);
  EXPECT_EQ(lease(a1, 40, 1000), 0u);
  d.advance(std::chrono::milliseconds(1000));
  Effects t = d.tick();
  EXPECT_NE(errors(t).find("was not granted before its deadline"), std::string::npos) << errors(t);
}

TEST_F(OccupancyTest, ShrinkMessagesAreRefusedFromTheWrongPeer) {
  FakeAgent a1 = add_agent("a1", 101);
  FakeAgent a2 = add_agent("a2", 102);
  uint64_t j1 = submit(10, 60);
  ASSERT_NE(lease(a1, 10), 0u);
  ASSERT_NE(lease(a1, 50), 0u);  // 60%: 50 MiB past its share
  submit(40, 40);                // 40 free + 50 reclaimable
  ASSERT_NE(lease(a2, 30), 0u);
  Effects e;
  ASSERT_EQ(lease(a2, 10, 5000, &e), 0u);  // 90 + 10 = 100%: a1 is asked
  const proto::ShrinkT* s = shrink_of(e, a1);
  ASSERT_NE(s, nullptr);
  uint64_t id = s->id;
  // a2 answering a1's Shrink is refused and changes nothing.
  Effects wrong = d.shrink_done(a2, id, 50 * MiB);
  EXPECT_NE(errors(wrong).find("was not asked of agent 'a2'"), std::string::npos) << errors(wrong);
  EXPECT_EQ(status().devices[0]->occupancy->shrinks_pending, 1u);
  // A client cannot send the coordinator a Shrink or a ShrinkDone.
  Effects fake = d.request("client", "client", {}, proto::Body::Shrink, [&](auto& fbb) {
    return proto::CreateShrink(fbb, 1, fbb.CreateString("a1"), 0, 0, 50 * MiB).Union();
  });
  EXPECT_NE(errors(fake).find("not a request the coordinator serves"), std::string::npos)
      << errors(fake);
  Effects fake_done = d.request("client", "client", {}, proto::Body::ShrinkDone, [&](auto& fbb) {
    return proto::CreateShrinkDone(fbb, id, 50 * MiB).Union();
  });
  EXPECT_NE(errors(fake_done).find("not registered"), std::string::npos) << errors(fake_done);
  EXPECT_EQ(status().devices[0]->occupancy->shrinks_pending, 1u);
  EXPECT_EQ(d.job(j1).shrinks, 0u);
}

TEST_F(OccupancyTest, FifoAdmitsEverythingAndNeverShrinks) {
  CoreDriver fifo(options(), 100 * MiB);
  FakeAgent a1 = fifo.register_agent("a1", 101);
  FakeAgent a2 = fifo.register_agent("a2", 102);
  uint64_t j1 = 0, j2 = 0;
  fifo.submit(j1, [](proto::JobSpecT& s) { s.memory_budget = "60MiB"; });
  fifo.submit(j2, [](proto::JobSpecT& s) { s.memory_budget = "60MiB"; });
  EXPECT_EQ(fifo.job(j1).state, JobState::Running);
  EXPECT_EQ(fifo.job(j2).state, JobState::Running) << "budgets over-commit the pool";
  ASSERT_NE(granted_lease(fifo.lease(a1, 60 * MiB, 0), a1), 0u);
  Effects e = fifo.lease(a2, 60 * MiB, 5000);
  EXPECT_EQ(shrink_of(e, a1), nullptr);
  EXPECT_TRUE(e.notices.empty());
}

}  // namespace
}  // namespace leasehold::testing
