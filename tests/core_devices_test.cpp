// Several devices under one core, with a fake clock: agents bound to a
// device, leases and regions never crossing devices, placement by room
// (and by pin), queue order per device, fences kept on their device, and
// what status and the metrics say of each device.
#include <gtest/gtest.h>

#include "coordinator/metrics.h"
#include "coordinator/occupancy_policy.h"
#include "tests/support/core_driver.h"

namespace leasehold::testing {
namespace {

constexpr uint64_t MiB = 1ull << 20;

class DevicesTest : public ::testing::Test {
 protected:
  // Three host devices of 64 MiB under the occupancy policy.
  DevicesTest()
      : d(job_options(), std::vector<uint64_t>{64 * MiB, 64 * MiB, 64 * MiB},
          std::make_unique<OccupancyPolicy>(OccupancyOptions{})) {}

  FakeAgent worker(const std::string& name, int pid, int device) {
    return d.register_agent(name, pid, {}, nullptr, true, device);
  }
  FakeAgent leaser(const std::string& name, int pid, int device) {
    return d.register_agent(name, pid, {}, nullptr, false, device);
  }
  int device_of(const FakeAgent& a) { return d.core().agents().at(a.name).device; }
  uint64_t job_on(const FakeAgent& a) { return d.core().agents().at(a.name).job_id; }

  // A job with a guaranteed share of `mib` MiB, on `device` ("auto", "cpu:1").
  uint64_t submit(int mib, const std::string& device = "auto") {
    uint64_t id = 0;
    d.submit(id, [&](proto::JobSpecT& s) {
      s.memory_budget = std::to_string(mib) + "MiB";
      s.device = device;
    });
    return id;
  }

  // The lease granted to `a` in `e`, as the wire says it.
  static const proto::LeaseT* grant(const Effects& e, const FakeAgent& a) {
    auto m = messages(e, proto::Body::LeaseGrant, a.rid);
    return m.empty() ? nullptr : m[0]->body.AsLeaseGrant()->lease.get();
  }

  proto::StatusReplyT status() { return d.status_reply(); }

  CoreDriver d;
};

TEST_F(DevicesTest, AnAgentLeasesOnlyFromItsOwnDevicesPool) {
  FakeAgent a = leaser("a", 101, 0);
  FakeAgent b = leaser("b", 102, 1);
  Effects e = d.lease(a, 64 * MiB, 0);
  const proto::LeaseT* la = grant(e, a);
  ASSERT_NE(la, nullptr) << errors(e);
  EXPECT_EQ(la->device, 0);
  EXPECT_EQ(la->holder, proto::LeaseHolder::Agent);
  const uint64_t a_lease = la->id;
  // Device 0 is full; device 1 is untouched, and a cannot spill over to it.
  e = d.lease(a, 2 * MiB, 0);
  EXPECT_EQ(error_code(e, a.rid), ErrorCode::NoSpace) << errors(e);
  e = d.lease(b, 64 * MiB, 0);
  const proto::LeaseT* lb = grant(e, b);
  ASSERT_NE(lb, nullptr) << errors(e);
  EXPECT_EQ(lb->device, 1);
  EXPECT_EQ(lb->offset, 0u) << "each device's offsets start at its own pool's base";
  EXPECT_NE(lb->id, a_lease) << "lease ids are unique across devices";
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 64 * MiB);
  EXPECT_EQ(d.core().device(1).leases.allocator().used_bytes(), 64 * MiB);
  EXPECT_EQ(d.core().device(2).leases.allocator().used_bytes(), 0u);
  // A lease id of another device's table is no lease of the agent's.
  e = d.release(b, a_lease);
  EXPECT_EQ(error_code(e, b.rid), ErrorCode::NoSuchLease) << "b released a lease of device 0";
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 64 * MiB);

  const auto s = status();
  ASSERT_EQ(s.devices.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(s.devices[i]->pool->info->device, i);
    EXPECT_EQ(s.devices[i]->pool->info->uuid, "host-" + std::to_string(i));
  }
  EXPECT_EQ(s.devices[0]->pool->used_bytes, 64 * MiB);
  EXPECT_EQ(s.devices[2]->pool->used_bytes, 0u);
  EXPECT_EQ(s.devices[1]->agents, 1u);
  ASSERT_EQ(s.leases.size(), 2u);
  for (const auto& l : s.leases) EXPECT_EQ(l->device, l->agent == "a" ? 0 : 1);
}

TEST_F(DevicesTest, RegisteringNamesADeviceServedOrGetsTheLeastPopulatedOne) {
  std::string why;
  try {
    d.register_agent("far", 100, {}, nullptr, true, 5);
  } catch (const std::logic_error& e) {
    why = e.what();  // the coordinator's error, as the driver passes it on
  }
  EXPECT_NE(why.find("device 5"), std::string::npos) << why;
  EXPECT_NE(why.find("serves devices 0, 1, 2"), std::string::npos) << why;
  EXPECT_FALSE(d.core().agents().count("far"));
  // Agents without --device spread over the devices, workers and leasers
  // each on their own count.
  FakeAgent w0 = worker("w0", 101, -1), w1 = worker("w1", 102, -1), w2 = worker("w2", 103, -1);
  FakeAgent w3 = worker("w3", 104, -1);
  FakeAgent l0 = leaser("l0", 105, -1);
  EXPECT_EQ(device_of(w0), 0);
  EXPECT_EQ(device_of(w1), 1);
  EXPECT_EQ(device_of(w2), 2);
  EXPECT_EQ(device_of(w3), 0);
  EXPECT_EQ(device_of(l0), 0);
  // The RegisterAck's pool is the agent's device's.
  Effects ack;
  d.register_agent("w4", 106, {}, &ack, true, 2);
  auto m = messages(ack, proto::Body::RegisterAck);
  ASSERT_EQ(m.size(), 1u);
  EXPECT_EQ(m[0]->body.AsRegisterAck()->pool->device, 2);
  EXPECT_EQ(m[0]->body.AsRegisterAck()->pool->uuid, "host-2");
}

TEST_F(DevicesTest, AJobGoesWhereThePolicyLeavesTheMostRoom) {
  // Device 0 is half full, device 1 a quarter, device 2 empty but with no
  // idle worker.
  FakeAgent l0 = leaser("l0", 100, 0), l1 = leaser("l1", 101, 1);
  ASSERT_NE(granted_lease(d.lease(l0, 32 * MiB, 0), l0), 0u);
  ASSERT_NE(granted_lease(d.lease(l1, 16 * MiB, 0), l1), 0u);
  FakeAgent w0 = worker("w0", 102, 0), w1 = worker("w1", 103, 1);
  const uint64_t job = submit(16);
  EXPECT_EQ(job_on(w1), job) << "device 1 has the most room left among those with a worker";
  EXPECT_EQ(job_on(w0), 0u);
  // A worker on the empty device: the next job goes there, not to device 0.
  FakeAgent w2 = worker("w2", 104, 2);
  const uint64_t next = submit(16);
  EXPECT_EQ(job_on(w2), next);
  EXPECT_EQ(job_on(w0), 0u);
  // A job no device admits waits, saying why (device 0 is the only one
  // with an idle worker, and 32 MiB are taken there).
  const uint64_t big = submit(48);
  EXPECT_EQ(d.job(big).state, JobState::Queued);
  EXPECT_NE(d.job(big).waiting_for.find("waiting for"), std::string::npos)
      << d.job(big).waiting_for;
  EXPECT_EQ(job_on(w0), 0u);
}

TEST_F(DevicesTest, APinnedJobWaitsForItsDeviceWithoutHoldingOthersBack) {
  FakeAgent w0 = worker("w0", 100, 0), w1 = worker("w1", 101, 1);
  const uint64_t first = submit(8, "cpu:0");
  EXPECT_EQ(job_on(w0), first);
  // Device 0's only worker is busy: a second job pinned there waits, and
  // a job behind it for any device starts on device 1 meanwhile.
  const uint64_t pinned = submit(8, "cpu:0");
  const uint64_t any = submit(8);
  EXPECT_EQ(d.job(pinned).state, JobState::Queued);
  EXPECT_EQ(d.job(pinned).waiting_for, "waiting for an idle agent");
  EXPECT_EQ(job_on(w1), any);
  // When device 0's worker is free again, the pinned job takes it.
  d.heartbeat(w0, {{first, 1, proto::JobPhase::Running}});
  d.update(w0, first, 1, "succeeded");
  d.heartbeat(w0, {});
  EXPECT_EQ(job_on(w0), pinned);
}

TEST_F(DevicesTest, JobsForOneDeviceStartInQueueOrder) {
  FakeAgent l0 = leaser("l0", 100, 0);
  ASSERT_NE(granted_lease(d.lease(l0, 40 * MiB, 0), l0), 0u);
  // A large job pinned to device 0 cannot start there yet; a small one
  // behind it, also for device 0, must not overtake it (it would starve).
  const uint64_t large = submit(40, "cpu:0");
  const uint64_t small = submit(8, "cpu:0");
  FakeAgent w0 = worker("w0", 101, 0);
  EXPECT_EQ(job_on(w0), 0u);
  EXPECT_EQ(d.job(large).state, JobState::Queued);
  EXPECT_EQ(d.job(small).state, JobState::Queued);
  // Once the memory is back, the large one starts first.
  d.release(l0, d.core().device(0).leases.leases().begin()->first);
  d.heartbeat(w0, {});
  EXPECT_EQ(job_on(w0), large);
}

TEST_F(DevicesTest, SubmitRefusesADeviceNotServedAndSizesBeyondThePinnedPool) {
  Effects e = d.request("client", "client", {}, proto::Body::SubmitJob, [](auto& fbb) {
    proto::JobSpecT spec = CoreDriver::small_job("far");
    spec.device = "cpu:7";
    return proto::CreateSubmitJob(fbb, proto::JobSpec::Pack(fbb, &spec)).Union();
  });
  std::string why = errors(e);
  EXPECT_NE(why.find("'cpu:7'"), std::string::npos) << why;
  EXPECT_NE(why.find("devices 0, 1, 2"), std::string::npos) << why;
  e = d.request("client", "client", {}, proto::Body::SubmitJob, [](auto& fbb) {
    proto::JobSpecT spec = CoreDriver::small_job("odd");
    spec.device = "cuda:one";
    return proto::CreateSubmitJob(fbb, proto::JobSpec::Pack(fbb, &spec)).Union();
  });
  why = errors(e);
  EXPECT_NE(why.find("cuda:N or cpu:N"), std::string::npos) << why;
  EXPECT_TRUE(d.core().jobs().all().empty());
}

TEST_F(DevicesTest, EachDeviceHasRegionsOfItsOwn) {
  FakeAgent a = leaser("a", 100, 0), b = leaser("b", 101, 1);
  Effects e = d.attach(a, "data/x", 4 * MiB, true);
  const auto* ga = region_grant(e, a);
  ASSERT_NE(ga, nullptr) << errors(e);
  EXPECT_TRUE(ga->fill);
  EXPECT_EQ(ga->region->device, 0);
  d.region_ready(a, "data/x");
  // The same name on device 1 is another region: b fills its own copy.
  e = d.attach(b, "data/x", 4 * MiB, true);
  const auto* gb = region_grant(e, b);
  ASSERT_NE(gb, nullptr) << errors(e);
  EXPECT_TRUE(gb->fill) << "device 0's copy is in another GPU's memory";
  EXPECT_EQ(gb->region->device, 1);
  d.region_ready(b, "data/x");
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 4 * MiB);
  EXPECT_EQ(d.core().device(1).leases.allocator().used_bytes(), 4 * MiB);
  for (const auto& l : status().leases) EXPECT_EQ(l->holder, proto::LeaseHolder::Region);
  const auto list = d.regions();
  ASSERT_EQ(list.regions.size(), 2u);
  EXPECT_EQ(list.regions[0]->device + list.regions[1]->device, 1);
  EXPECT_EQ(list.misses, 2u);
  // Dropping the name drops both copies once nobody is attached.
  d.detach(a, "data/x");
  e = d.drop_region("data/x");
  EXPECT_EQ(error_code(e, "client"), ErrorCode::RegionBusy) << "b is still attached on device 1";
  EXPECT_EQ(d.regions().regions.size(), 2u) << "a refused drop drops nothing";
  d.detach(b, "data/x");
  e = d.drop_region("data/x");
  EXPECT_EQ(errors(e), "");
  EXPECT_TRUE(d.regions().regions.empty());
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 0u);
  EXPECT_EQ(d.core().device(1).leases.allocator().used_bytes(), 0u);
}

TEST_F(DevicesTest, FencedLeasesStayOnTheirDeviceAndBindTheAgentThere) {
  FakeAgent a = leaser("a", 100, 1);
  ASSERT_NE(granted_lease(d.lease(a, 8 * MiB, 0), a), 0u);
  // Silent past the limit while its process lives: its lease is fenced.
  d.advance(std::chrono::milliseconds(11000));
  d.tick();
  EXPECT_FALSE(d.core().agents().count("a"));
  const auto& leases = d.core().device(1).leases.leases();
  ASSERT_EQ(leases.size(), 1u);
  EXPECT_EQ(leases.begin()->second.owner, LeaseOwner::fenced("a"));
  auto s = status();
  ASSERT_EQ(s.fences.size(), 1u);
  EXPECT_EQ(s.fences[0]->device, 1);
  ASSERT_EQ(s.leases.size(), 1u);
  EXPECT_EQ(s.leases[0]->holder, proto::LeaseHolder::Fenced);
  EXPECT_EQ(s.leases[0]->agent, "a");
  // Coming back it works on device 1 while the fence holds; another device
  // is refused, naming why.
  std::string why;
  try {
    d.register_agent("a", 100, {}, nullptr, false, 0);
  } catch (const std::logic_error& e) {
    why = e.what();
  }
  EXPECT_NE(why.find("fenced on device 1"), std::string::npos) << why;
  FakeAgent again = leaser("a", 100, -1);
  EXPECT_EQ(device_of(again), 1);
  // Its process exits: the fence goes, device 1's memory comes back.
  d.gone.insert(100);
  d.tick();
  EXPECT_EQ(d.core().device(1).leases.allocator().used_bytes(), 0u);
  EXPECT_EQ(d.core().device(0).leases.allocator().used_bytes(), 0u);
}

TEST_F(DevicesTest, MetricsHaveASeriesPerDeviceAndJobsCarryTheirs) {
  FakeAgent l2 = leaser("l2", 100, 2);
  ASSERT_NE(granted_lease(d.lease(l2, 10 * MiB, 0), l2), 0u);
  FakeAgent w1 = worker("w1", 101, 1);
  const uint64_t job = submit(8);
  ASSERT_EQ(job_on(w1), job);
  const std::string m = render_metrics(take_metrics_snapshot(d.core(), d.core().status(d.now())));
  EXPECT_NE(m.find("leasehold_pool_used_bytes{gpu=\"2\",UUID=\"host-2\"} 10485760\n"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("leasehold_pool_used_bytes{gpu=\"0\",UUID=\"host-0\"} 0\n"), std::string::npos)
      << m;
  EXPECT_NE(m.find("leasehold_agents{gpu=\"1\",UUID=\"host-1\",state=\"running\"} 1\n"),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("leasehold_job_leased_bytes{gpu=\"1\",UUID=\"host-1\",job_id=\"" +
                   std::to_string(job) + "\""),
            std::string::npos)
      << m;
  EXPECT_NE(m.find("leasehold_jobs{state=\"running\"} 1\n"), std::string::npos) << m;
}

TEST(DevicesOfDifferentSizes, AJobTooLargeForADeviceNeitherGoesThereNorHoldsItBack) {
  CoreDriver d(job_options(), std::vector<uint64_t>{32 * MiB, 128 * MiB},
               std::make_unique<OccupancyPolicy>(OccupancyOptions{}));
  FakeAgent w0 = d.register_agent("w0", 100, {}, nullptr, true, 0);
  // 64 MiB fits only device 1, which has no worker yet: it waits, and a
  // small job behind it still starts on device 0.
  uint64_t large = 0, small = 0;
  d.submit(large, [](proto::JobSpecT& s) { s.memory_budget = "64MiB"; });
  d.submit(small, [](proto::JobSpecT& s) { s.memory_budget = "8MiB"; });
  EXPECT_EQ(d.job(large).state, JobState::Queued);
  EXPECT_EQ(d.core().agents().at("w0").job_id, small)
      << "device 0 was held for a job it cannot take";
  EXPECT_EQ(d.job(large).budget_bytes, 64 * MiB);
  FakeAgent w1 = d.register_agent("w1", 101, {}, nullptr, true, 1);
  EXPECT_EQ(d.core().agents().at("w1").job_id, large);
}

TEST_F(DevicesTest, AnAgentRegisteringAgainGoesBackToItsDevice) {
  FakeAgent w0 = worker("w0", 100, -1), w1 = worker("w1", 101, -1), w2 = worker("w2", 102, -1);
  ASSERT_EQ(device_of(w2), 2);
  // w0 leaves; w2 registers again without --device, naming the device it
  // had: it gets it back though device 0 now has the fewest agents.
  d.request(w0.rid, w0.name, w0.session, proto::Body::Unregister,
            [](auto& fbb) { return proto::CreateUnregister(fbb).Union(); });
  Effects e = d.request("rid-w2-again", "w2", w2.session, proto::Body::Register, [](auto& fbb) {
    return proto::CreateRegister(fbb, fbb.CreateString("w2"), 102, -1, 0, true, true, 0, 0, 0, 0, 0,
                                 0, 0, 0, 0, /*preferred_device=*/2)
        .Union();
  });
  ASSERT_EQ(errors(e), "");
  EXPECT_EQ(d.core().agents().at("w2").device, 2);
  // A preferred device that is not served is no error: the core picks.
  e = d.request("rid-w3", "w3", {}, proto::Body::Register, [](auto& fbb) {
    return proto::CreateRegister(fbb, fbb.CreateString("w3"), 103, -1, 0, true, true, 0, 0, 0, 0, 0,
                                 0, 0, 0, 0, /*preferred_device=*/9)
        .Union();
  });
  ASSERT_EQ(errors(e), "");
  EXPECT_EQ(d.core().agents().at("w3").device, 0);
}

TEST_F(DevicesTest, AJobStartingFromParametersGoesToTheDeviceThatHasThem) {
  FakeAgent l1 = leaser("l1", 100, 1);
  Effects e = d.attach(l1, "params/base", 2 * MiB, true);
  ASSERT_NE(region_grant(e, l1), nullptr) << errors(e);
  d.region_ready(l1, "params/base");
  d.detach(l1, "params/base");
  FakeAgent w0 = worker("w0", 101, 0), w1 = worker("w1", 102, 1);
  uint64_t id = 0;
  d.submit(id, [](proto::JobSpecT& s) {
    s.memory_budget = "8MiB";
    s.init_from = "base";
  });
  EXPECT_EQ(job_on(w1), id) << "device 0 has more room, but the parameters are on device 1";
  EXPECT_EQ(job_on(w0), 0u);
}

TEST(DevicesUnderMps, AFaultOnOneGpuEndsNothingOnAnother) {
  CoreOptions o = job_options();
  o.mps_pipe_directory = "/run/leasehold/mps-pipe";
  CoreDriver d(o, std::vector<uint64_t>{64 * MiB, 64 * MiB});
  FakeAgent a = d.register_agent("a", 100, {}, nullptr, true, 0);
  FakeAgent b = d.register_agent("b", 101, {}, nullptr, true, 1);
  uint64_t ja = 0, jb = 0;
  d.submit(ja, [](proto::JobSpecT& s) { s.device = "cpu:0"; });
  d.submit(jb, [](proto::JobSpecT& s) { s.device = "cpu:1"; });
  ASSERT_EQ(d.core().agents().at("a").job_id, ja);
  ASSERT_EQ(d.core().agents().at("b").job_id, jb);
  d.heartbeat(a, {{ja, 1, proto::JobPhase::Running}});
  d.heartbeat(b, {{jb, 1, proto::JobPhase::Running}});
  // Job a faults on GPU 0 while job b runs on GPU 1: alone on its GPU, the
  // fault is its own (counted), and GPU 1's agent keeps its context.
  d.device_fault(a, ja, 1, "illegal memory access");
  EXPECT_EQ(d.job(ja).agent_failures, 1u);
  EXPECT_EQ(d.job(ja).state, JobState::Queued) << "its agent restarts";
  EXPECT_TRUE(d.core().agents().at("a").context_lost);
  EXPECT_FALSE(d.core().agents().at("b").context_lost);
  EXPECT_EQ(d.job(jb).state, JobState::Running);
}

}  // namespace
}  // namespace leasehold::testing
