// The coordinator's core with a fake clock: agents, heart-beats, purging and
// leases. No sockets, no processes, no sleeping.
#include <gtest/gtest.h>

#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

CoreOptions options() {
  CoreOptions o;
  o.heartbeat_interval = 1000ms;
  o.lease_wait_timeout = 5000ms;
  o.first_heartbeat_grace = 10000ms;
  return o;
}

TEST(CoreAgents, AnAgentWhoseProcessExitedIsPurgedAtTheNextTickAndItsLeasesReclaimed) {
  CoreDriver d(options());
  FakeAgent a = d.register_agent("a", 11);
  d.heartbeat(a);  // ends the first-heartbeat grace
  ASSERT_EQ(messages(d.lease(a, 3 << 20, 0), proto::Body::LeaseGrant).size(), 1u);
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 3u << 20);
  d.gone.insert(11);  // killed: the kernel says so, no silence to wait for
  d.advance(250ms);
  d.tick();
  EXPECT_FALSE(d.core().agents().count("a"));
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 0u);
  EXPECT_TRUE(d.core().device(0).leases.leases().empty());
}

// A stopped process (SIGSTOP, a debugger) is fenced after two silent
// intervals; one that runs (a saturated host) keeps its session, and gets no
// new job, until silence_limit; so does a network agent.
TEST(CoreAgents, SilenceFencesAStoppedAgentAfterTwoIntervalsAndARunningOneAtTheLimit) {
  for (const char* kind : {"stopped", "running", "network"}) {
    SCOPED_TRACE(kind);
    CoreOptions o = options();
    o.silence_limit = 10000ms;
    CoreDriver d(o);
    if (std::string(kind) == "network") d.peer = Peer{};  // not followed
    FakeAgent a = d.register_agent("a", 11);
    FakeAgent b = d.register_agent("b", 12);
    d.heartbeat(a);
    ASSERT_EQ(messages(d.lease(a, 3 << 20, 0), proto::Body::LeaseGrant).size(), 1u);
    if (std::string(kind) == "stopped") d.stopped.insert(11);
    // The broker ticks every interval/4.
    for (int i = 1; i <= 8; ++i) {
      d.advance(250ms);
      d.heartbeat(b);
      d.tick();
      ASSERT_TRUE(d.core().agents().count("a")) << "fenced after only " << i * 250 << " ms";
    }
    d.advance(250ms);
    d.heartbeat(b);
    d.tick();
    if (std::string(kind) == "stopped") {
      EXPECT_FALSE(d.core().agents().count("a"));
    } else {
      ASSERT_TRUE(d.core().agents().count("a"));
      EXPECT_TRUE(d.core().agents().at("a").late);
      uint64_t id = 0;
      d.submit(id);
      EXPECT_EQ(d.job(id).agent, "b") << "a late agent gets no new job";
      for (int i = 0; i < 31; ++i) {  // to 9.75 s
        d.advance(250ms);
        d.heartbeat(b);
        d.tick();
      }
      EXPECT_TRUE(d.core().agents().count("a"));
      d.advance(500ms);
      d.heartbeat(b);
      d.tick();
      EXPECT_FALSE(d.core().agents().count("a"));
    }
    // Fenced, not freed: its process may still write there.
    EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 3u << 20);
  }
}

// A late agent heard again is an agent like any other.
TEST(CoreAgents, ALateAgentHeardAgainTakesJobsAgain) {
  CoreDriver d(options());
  FakeAgent a = d.register_agent("a", 11);
  d.heartbeat(a);
  d.advance(3000ms);
  d.tick();
  EXPECT_TRUE(d.core().agents().at("a").late);
  d.heartbeat(a);
  EXPECT_FALSE(d.core().agents().at("a").late);
  uint64_t id = 0;
  d.submit(id);
  EXPECT_EQ(d.job(id).agent, "a");
}

// The coordinator's own stall (stopped, starved, a slow disk) is nobody's
// silence: agents and fences are credited with it.
TEST(CoreAgents, TheCoordinatorsOwnStallIsNotCountedAsAgentsSilence) {
  CoreOptions o = options();
  o.recovery_grace = 5000ms;
  CoreDriver d(o);
  FakeAgent a = d.register_agent("a", 11);
  FakeAgent c = d.register_agent("c", 13);
  d.heartbeat(a);
  d.heartbeat(c);
  ASSERT_EQ(messages(d.lease(c, 2 << 20, 0), proto::Body::LeaseGrant).size(), 1u);
  d.stopped.insert(13);
  d.advance(2250ms);
  d.heartbeat(a);
  d.tick();
  ASSERT_FALSE(d.core().agents().count("c"));  // fenced, its grace begins
  // A job assigned to a, not acknowledged yet (a has assign_timeout), and a
  // lease request waiting for memory (until its deadline).
  uint64_t id = 0;
  d.submit(id);
  ASSERT_EQ(d.job(id).agent, "a");
  FakeAgent b = d.register_agent("b", 12, {}, nullptr, /*takes_jobs=*/false);
  d.heartbeat(b);
  Effects waiting = d.lease(b, 63 << 20, 20000);
  ASSERT_TRUE(messages(waiting, proto::Body::Error).empty()) << errors(waiting);
  ASSERT_TRUE(messages(waiting, proto::Body::LeaseGrant).empty()) << "it waits for c's memory";
  // The coordinator stops for 60 s (SIGSTOP): the broker tells the core.
  d.advance(60000ms);
  d.core().stalled(60000ms - 250ms, d.now());
  Effects after = d.tick();
  EXPECT_TRUE(d.core().agents().count("a")) << "a was not silent: nobody listened";
  EXPECT_EQ(d.job(id).attempts.size(), 1u) << "the assignment's clock stood still";
  EXPECT_EQ(d.job(id).agent, "a");
  EXPECT_TRUE(messages(after, proto::Body::Error).empty()) << "the lease request still waits";
  EXPECT_FALSE(d.core().agents().at("a").late);
  EXPECT_TRUE(d.killed.empty()) << "the fence's grace did not run during the stall";
  d.advance(5000ms);
  d.heartbeat(a);
  d.tick();
  EXPECT_EQ(d.killed, std::vector<int>{13});
  // A stall credits no agent past the present: one heard during it keeps
  // its clock.
  d.advance(1000ms);
  d.heartbeat(a);
  d.core().stalled(30000ms, d.now());
  d.advance(10500ms);
  d.tick();
  EXPECT_FALSE(d.core().agents().count("a"));
}

// An agent that falls silent while its process lives on (hung, stopped)
// may still write into its leases: they are fenced, held back from everyone,
// until it comes back having stopped or its process has exited. After the
// grace the coordinator ends a process of its own user to get there.
TEST(CoreAgents, LeasesOfASilentLiveAgentAreFencedUntilItStops) {
  CoreOptions o = options();
  o.recovery_grace = 5000ms;
  CoreDriver d(o, 8ull << 20);
  FakeAgent a = d.register_agent("a", 11);
  FakeAgent b = d.register_agent("b", 12);
  d.heartbeat(a);
  ASSERT_EQ(messages(d.lease(a, 6 << 20, 0), proto::Body::LeaseGrant).size(), 1u);
  Effects waiting = d.lease(b, 4 << 20, 60000);
  EXPECT_TRUE(waiting.messages.empty());
  d.stopped.insert(11);
  d.advance(2300ms);
  d.heartbeat(b);
  Effects purge = d.tick();
  EXPECT_FALSE(d.core().agents().count("a"));
  EXPECT_TRUE(messages(purge, proto::Body::LeaseGrant).empty()) << "a may still write there";
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 6u << 20);
  // It comes back, says it runs nothing: the fence goes, b gets its lease.
  d.stopped.erase(11);
  Effects back;
  d.register_agent("a", 11, {}, &back);
  auto granted = messages(back, proto::Body::LeaseGrant, b.rid);
  EXPECT_EQ(granted.size(), 1u);

  // Silent again, and this time it never comes back: killed after the
  // grace, released once it has exited.
  FakeAgent c = d.register_agent("c", 13);
  d.heartbeat(c);
  ASSERT_EQ(messages(d.lease(c, 2 << 20, 0), proto::Body::LeaseGrant).size(), 1u);
  uint64_t used = d.core().device(0).leases.allocator().used_bytes();
  d.stopped.insert(13);
  d.advance(2300ms);
  d.heartbeat(b);
  d.tick();
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), used);
  d.advance(3000ms);
  d.heartbeat(b);
  d.tick();
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), used) << "within the grace";
  EXPECT_TRUE(d.killed.empty());
  d.advance(2100ms);
  d.heartbeat(b);
  d.tick();
  EXPECT_EQ(d.killed, std::vector<int>{13});
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), used) << "killed, exiting";
  d.tick();  // it has exited (the fake process exits at once)
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), used - (2u << 20));
}

// The memory of a silent agent whose process the coordinator cannot end
// (another user's; end_silent_agents off) is given to nobody, however long
// it stays silent; status says why. It goes once the process exits.
TEST(CoreAgents, ASilentAgentThatCannotBeEndedKeepsItsMemoryFencedUntilItExits) {
  for (bool may_end : {true, false}) {
    SCOPED_TRACE(may_end ? "another user's process" : "end_silent_agents off");
    CoreOptions o = options();
    o.recovery_grace = 5000ms;
    o.end_silent_agents = may_end;
    CoreDriver d(o, 8ull << 20);
    d.unendable.insert(11);
    FakeAgent a = d.register_agent("a", 11);
    FakeAgent b = d.register_agent("b", 12);
    d.heartbeat(a);
    ASSERT_EQ(messages(d.lease(a, 6 << 20, 0), proto::Body::LeaseGrant).size(), 1u);
    Effects waiting = d.lease(b, 4 << 20, 600000);
    for (int i = 0; i < 50; ++i) {  // 50 s, ten graces
      d.advance(1000ms);
      d.heartbeat(b);
      EXPECT_TRUE(messages(d.tick(), proto::Body::LeaseGrant).empty()) << "second " << i;
    }
    EXPECT_TRUE(d.killed.empty());
    EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 6u << 20);
    const auto st = d.core().status(d.now());
    ASSERT_EQ(st.fences.size(), 1u);
    EXPECT_EQ(st.fences[0]->agent, "a");
    EXPECT_EQ(st.fences[0]->bytes, 6u << 20);
    EXPECT_NE(st.fences[0]->state.find(may_end ? "cannot be ended: another user's process"
                                               : "end_silent_agents is off"),
              std::string::npos)
        << st.fences[0]->state;
    d.gone.insert(11);
    Effects exited = d.tick();
    EXPECT_EQ(messages(exited, proto::Body::LeaseGrant, b.rid).size(), 1u);
    EXPECT_TRUE(d.core().status(d.now()).fences.empty());
  }
}

// A network agent's process cannot be followed: its fenced memory waits for
// it to register again and report that it holds nothing of its old session.
TEST(CoreAgents, AFencedAgentThatRegistersAgainKeepsItsFenceWhileItHoldsOldLeases) {
  CoreOptions o = options();
  o.recovery_grace = 5000ms;
  CoreDriver d(o, 8ull << 20);
  d.peer = Peer::with_key("net", false, true);
  FakeAgent a = d.register_agent("a", 11);
  d.peer = Peer::local(1000, 1000, 4242);
  FakeAgent b = d.register_agent("b", 12);
  d.heartbeat(a);
  ASSERT_EQ(messages(d.lease(a, 6 << 20, 0), proto::Body::LeaseGrant).size(), 1u);
  d.lease(b, 4 << 20, 600000);
  for (int i = 0; i < 20; ++i) {
    d.advance(1000ms);
    d.heartbeat(b);
    EXPECT_TRUE(messages(d.tick(), proto::Body::LeaseGrant).empty());
  }
  EXPECT_NE(d.core().status(d.now()).fences[0]->state.find("a network agent"), std::string::npos);
  // Back, but a thread of it still holds a lease of the lost session.
  d.peer = Peer::with_key("net", false, true);
  d.stale_holds = 1;
  Effects back;
  a = d.register_agent("a", 11, {}, &back);
  EXPECT_TRUE(messages(back, proto::Body::LeaseGrant).empty());
  EXPECT_TRUE(messages(d.heartbeat(a), proto::Body::LeaseGrant).empty());
  EXPECT_NE(d.core().status(d.now()).fences[0]->state.find("registered again"), std::string::npos);
  d.stale_holds = 0;
  EXPECT_EQ(messages(d.heartbeat(a), proto::Body::LeaseGrant, b.rid).size(), 1u)
      << "it let go of its old leases";
}

TEST(CoreAgents, AnAgentThatTakesNoJobsIsNeverGivenOne) {
  CoreDriver d(options());
  FakeAgent lessee = d.register_agent("lessee", 11, {}, nullptr, false);
  uint64_t id = 0;
  d.submit(id);
  d.heartbeat(lessee);
  EXPECT_EQ(d.job(id).state, JobState::Queued);
  Effects e = d.request("cli", "cli", {}, proto::Body::StatusRequest,
                        [](auto& fbb) { return proto::CreateStatusRequest(fbb).Union(); });
  EXPECT_EQ(messages(e, proto::Body::StatusReply)[0]->body.AsStatusReply()->agents[0]->state,
            proto::AgentState::Idle);
}

TEST(CoreAgents, NewAgentHasAGraceUntilItsFirstHeartbeat) {
  CoreDriver d(options());
  d.register_agent("slow", 12);
  d.advance(9500ms);
  d.tick();
  EXPECT_TRUE(d.core().agents().count("slow")) << "mapping the pool may take seconds";
  d.advance(2600ms);  // past the grace plus two intervals: late, its process runs
  d.tick();
  EXPECT_TRUE(d.core().agents().count("slow"));
  EXPECT_TRUE(d.core().agents().at("slow").late);
  d.advance(8000ms);  // past the grace plus silence_limit
  d.tick();
  EXPECT_FALSE(d.core().agents().count("slow"));
}

TEST(CoreAgents, AnAgentKilledBeforeItsFirstHeartbeatIsDroppedAtOnce) {
  CoreDriver d(options());
  FakeAgent a = d.register_agent("a", 11);
  uint64_t id = 0;
  d.submit(id);
  EXPECT_EQ(d.job(id).agent, "a");
  d.gone.insert(11);
  d.advance(250ms);
  d.tick();
  EXPECT_FALSE(d.core().agents().count("a")) << "no 10 s grace for a process that is gone";
  EXPECT_EQ(d.job(id).state, JobState::Queued);
  EXPECT_EQ(d.job(id).agent_failures, 1u);
}

TEST(CoreAgents, UnknownSessionIsRefusedAndChangesNothing) {
  CoreDriver d(options());
  FakeAgent a = d.register_agent("a", 11);
  FakeAgent forged = a;
  forged.session.lo += 1;  // the old tokens counted up: a neighbour was one away
  Effects e = d.lease(forged, 1 << 20, 0);
  ASSERT_EQ(messages(e, proto::Body::Error).size(), 1u);
  EXPECT_EQ(messages(e, proto::Body::Error)[0]->body.AsError()->code, ErrorCode::UnknownSender);
  EXPECT_TRUE(d.core().device(0).leases.leases().empty());
}

TEST(CoreAgents, NameOfALiveProcessIsTakenButADeadOneIsReplaced) {
  CoreDriver d(options());
  d.register_agent("w", 20);
  Effects e = d.request("other", "w", {}, proto::Body::Register, [](auto& fbb) {
    return proto::CreateRegister(fbb, fbb.CreateString("w"), 21).Union();
  });
  EXPECT_NE(errors(e).find("in use by live pid 20"), std::string::npos) << errors(e);
  d.gone.insert(20);
  FakeAgent b = d.register_agent("w", 21);
  EXPECT_EQ(d.core().agents().at("w").pid, 21);
  EXPECT_FALSE(b.session.empty());
}

// Taking over a live agent's name needs what only that agent knows: its
// instance (chosen by its process) or its session token. Its pid, which
// `leasehold status` shows, is not enough: such a Register is refused and
// the agent keeps its session and its leases.
TEST(CoreAgents, ARegisterCarryingAnotherAgentsPidDoesNotEvictIt) {
  CoreDriver d(options());
  FakeAgent victim = d.register_agent("victim", 20);
  ASSERT_EQ(d.lease(victim, 1 << 20, 0).messages.size(), 1u);
  for (uint64_t guess : {0ull, 1ull, 20ull}) {
    Effects e =
        d.request("attacker", "victim", {guess, 0}, proto::Body::Register, [guess](auto& fbb) {
          return proto::CreateRegister(fbb, fbb.CreateString("victim"), 20, -1, 0, true, true, 0, 0,
                                       guess, 0)
              .Union();
        });
    EXPECT_NE(errors(e).find("in use by live pid 20"), std::string::npos) << errors(e);
  }
  EXPECT_EQ(d.core().agents().at("victim").session, victim.session) << "still its session";
  EXPECT_EQ(d.core().device(0).leases.leases().size(), 1u) << "its lease is intact";
  Effects beat = d.heartbeat(victim);
  EXPECT_EQ(messages(beat, proto::Body::HeartbeatAck).size(), 1u);
  // The agent itself (same instance) registering again is let in.
  FakeAgent again = d.register_agent("victim", 20);
  EXPECT_NE(again.session, victim.session);
  EXPECT_TRUE(d.core().device(0).leases.leases().empty()) << "its old session's leases are void";
}

// Over tcp:// the pid an agent declares names no process of this host: a
// network agent is neither replaced nor purged because no such local
// process exists, only when it falls silent.
TEST(CoreAgents, ANetworkAgentsDeclaredPidSaysNothingAboutItsLife) {
  CoreDriver d(options());
  d.peer = Peer::with_key("gpu-box", false, true);
  FakeAgent a = d.register_agent("remote", 30);
  d.gone.insert(30);  // no process 30 here
  d.advance(std::chrono::milliseconds(100));
  d.tick();  // within its first-heartbeat grace
  ASSERT_TRUE(d.core().agents().count("remote")) << "not purged for a pid of another host";
  d.peer = Peer::with_key("intruder", false, true);
  Effects e = d.request("intruder", "remote", {}, proto::Body::Register, [](auto& fbb) {
    return proto::CreateRegister(fbb, fbb.CreateString("remote"), 30).Union();
  });
  EXPECT_EQ(error_code(e, "intruder"), ErrorCode::NameTaken) << errors(e);
  EXPECT_EQ(d.core().agents().at("remote").session, a.session) << "still its session";
  EXPECT_EQ(d.core().agents().at("remote").process, nullptr);
}

// Tokens are 128 random bits: two sessions share no half, and neither is
// a neighbour of the other.
TEST(CoreAgents, SessionTokensAreRandomAndWide) {
  CoreDriver d(options());
  FakeAgent a = d.register_agent("a", 11), b = d.register_agent("b", 12);
  EXPECT_NE(a.session.lo, b.session.lo);
  EXPECT_NE(a.session.hi, b.session.hi);
  EXPECT_NE(a.session.hi, 0u);
  EXPECT_GT(a.session.lo > b.session.lo ? a.session.lo - b.session.lo : b.session.lo - a.session.lo,
            1000u);
}

TEST(CoreAgents, WaitingLeaseIsGrantedWhenMemoryFreesOrFailsAtItsDeadline) {
  CoreDriver d(options(), 8ull << 20);
  FakeAgent a = d.register_agent("a", 11);
  FakeAgent b = d.register_agent("b", 12);
  Effects first = d.lease(a, 6 << 20, 0);
  auto grant = messages(first, proto::Body::LeaseGrant);
  ASSERT_EQ(grant.size(), 1u);
  uint64_t held = grant[0]->body.AsLeaseGrant()->lease->id;

  Effects waiting = d.lease(b, 4 << 20, 3000);
  EXPECT_TRUE(waiting.messages.empty()) << "it waits for memory";
  EXPECT_TRUE(d.core().next_deadline().has_value());
  d.advance(1000ms);
  d.heartbeat(a);
  d.heartbeat(b);
  Effects freed = d.request(a.rid, a.name, a.session, proto::Body::LeaseRelease, [&](auto& fbb) {
    return proto::CreateLeaseRelease(fbb, held).Union();
  });
  auto granted = messages(freed, proto::Body::LeaseGrant, b.rid);
  ASSERT_EQ(granted.size(), 1u);
  EXPECT_EQ(granted[0]->body.AsLeaseGrant()->lease->agent, "b");

  // A second waiter that never fits fails at its deadline, not before.
  Effects w2 = d.lease(a, 6 << 20, 2000);
  EXPECT_TRUE(w2.messages.empty());
  d.advance(1999ms);
  EXPECT_TRUE(messages(d.tick(), proto::Body::Error).empty());
  d.advance(1ms);
  Effects expired = d.tick();
  auto err = messages(expired, proto::Body::Error, a.rid);
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0]->body.AsError()->code, ErrorCode::Timeout);
}

TEST(CoreAgents, StatusListsAgentsLeasesAndUptime) {
  CoreDriver d(options());
  FakeAgent a = d.register_agent("a", 11);
  d.lease(a, 2 << 20, 0);
  d.advance(1500ms);
  Effects e = d.request("cli", "cli", {}, proto::Body::StatusRequest,
                        [](auto& fbb) { return proto::CreateStatusRequest(fbb).Union(); });
  auto replies = messages(e, proto::Body::StatusReply, "cli");
  ASSERT_EQ(replies.size(), 1u);
  const auto* s = replies[0]->body.AsStatusReply();
  ASSERT_EQ(s->agents.size(), 1u);
  EXPECT_EQ(s->agents[0]->state, proto::AgentState::Leasing);
  EXPECT_EQ(s->agents[0]->leased_bytes, 2u << 20);
  EXPECT_EQ(s->leases.size(), 1u);
  EXPECT_EQ(s->uptime_ms, 1500u);
  EXPECT_EQ(s->devices[0]->pool->used_bytes, 2u << 20);
}

}  // namespace
}  // namespace leasehold::testing
