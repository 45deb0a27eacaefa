// Multi-process integration tests on the host backend: a real coordinator,
// real agent processes, and raw ZeroMQ peers.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <zmq.hpp>

#include "lease_client/session.h"
#include "shared/chunk_channel.h"
#include "shared/connection.h"
#include "shared/device.h"
#include "tests/support/faults.h"
#include "shared/protocol.h"
#include "tests/support/cluster.h"
#include "tests/support/isolation.h"
#include "tests/support/net.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

constexpr auto kHeartbeat = 200ms;

class HostCluster : public ::testing::Test {
 protected:
  std::vector<std::string> coordinator_args() const {
    return {"--backend",   "host",  "--pool-size",          "64MiB",
            "--alignment", "64KiB", "--heartbeat-interval", "200ms",
            "--log-level", "debug"};
  }
  AgentOptions session_options(const std::string& name) const {
    AgentOptions o;
    o.endpoint = cluster.endpoint();
    o.name = name;
    return o;
  }
  Cluster cluster;
};

TEST_F(HostCluster, ThreeAgentsKeepTheirPatternsIntact) {
  cluster.start_coordinator(coordinator_args());
  run_isolation_scenario(cluster, 3, "1MiB");
}

// The first chunk of the pool mapped read-write into process `pid`, from
// its /proc/PID/maps (the host backend's chunks are memfds named
// "leasehold-chunk"); 0 when none is.
uintptr_t first_mapped_chunk(pid_t pid) {
  std::ifstream maps("/proc/" + std::to_string(pid) + "/maps");
  std::string line;
  while (std::getline(maps, line)) {
    if (line.find("leasehold-chunk") == std::string::npos) continue;
    std::istringstream fields(line);
    std::string range, perms;
    fields >> range >> perms;
    if (perms.rfind("rw", 0) != 0) continue;
    return static_cast<uintptr_t>(std::stoull(range.substr(0, range.find('-')), nullptr, 16));
  }
  return 0;
}

TEST_F(HostCluster, AStrayWriteFaultsInItsWriterAloneAndNoPatternChanges) {
  cluster.start_coordinator(coordinator_args());
  run_stray_write_scenario(cluster, "1MiB");
}

TEST_F(HostCluster, VerificationDetectsAForeignWrite) {
  // The isolation check must be able to fail: write into an agent's lease
  // from outside and see the agent report it. No session can map another's
  // lease any more, so the write goes where a debugger's would: through
  // /proc/PID/mem of the agent (our child), at its mapping of the chunk.
  cluster.start_coordinator(coordinator_args());
  auto& victim = cluster.start_agent("victim", {"--exercise", "--leases", "1", "--lease-size",
                                                "256KiB", "--rounds", "0", "--interval", "50ms"});
  ASSERT_TRUE(cluster.wait_for([](const auto& s) { return leased_by(s, "victim") > 0; }, 5s));
  uintptr_t chunk = 0;
  ASSERT_TRUE(eventually([&] { return (chunk = first_mapped_chunk(victim.pid())) != 0; }, 5s));
  std::fstream mem("/proc/" + std::to_string(victim.pid()) + "/mem",
                   std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(mem.is_open()) << "cannot open the agent's memory (ptrace rules)";
  uint64_t word = 0;
  mem.seekg(static_cast<std::streamoff>(chunk + 3 * sizeof word));
  mem.read(reinterpret_cast<char*>(&word), sizeof word);
  word ^= 1;
  mem.seekp(static_cast<std::streamoff>(chunk + 3 * sizeof word));
  mem.write(reinterpret_cast<const char*>(&word), sizeof word);
  mem.flush();
  auto rc = victim.wait(5s);
  ASSERT_TRUE(rc) << victim.log();
  EXPECT_EQ(*rc, 3);
  EXPECT_NE(victim.log().find("CORRUPTION"), std::string::npos) << victim.log();
}

TEST_F(HostCluster, KilledAgentIsReclaimedPromptly) {
  auto& coordinator = cluster.start_coordinator(coordinator_args());
  auto& doomed = cluster.start_agent("doomed", {"--exercise", "--leases", "2", "--lease-size",
                                                "1MiB", "--rounds", "0", "--interval", "20ms"});
  ASSERT_TRUE(
      cluster.wait_for([](const auto& s) { return leased_by(s, "doomed") == 2u << 20; }, 5s));
  doomed.signal(SIGKILL);
  auto killed = std::chrono::steady_clock::now();
  ASSERT_TRUE(doomed.wait(2s));
  bool reclaimed = cluster.wait_for(
      [](const auto& s) { return !has_agent(s, "doomed") && s["leases"].empty(); }, 5s);
  auto took = std::chrono::steady_clock::now() - killed;
  ASSERT_TRUE(reclaimed);
  // The exact rule (purged within 2.25 intervals) is checked with a fake
  // clock in CoreAgents.SilentAgentIsPurgedAfterTwoIntervalsAndItsLeasesReclaimed;
  // here, with real processes on busy cores, only that it happens promptly.
  EXPECT_LT(took, 10 * kHeartbeat)
      << "reclaim took " << std::chrono::duration_cast<std::chrono::milliseconds>(took).count()
      << " ms";
  auto s = *cluster.status();
  EXPECT_EQ(s["devices"][0]["used_bytes"], 0);
  EXPECT_NE(coordinator.log().find("'doomed'"), std::string::npos);
  EXPECT_NE(coordinator.log().find("reclaimed 2 leases"), std::string::npos) << coordinator.log();
}

TEST_F(HostCluster, AgentsRegisterAgainAfterCoordinatorRestart) {
  auto& first = cluster.start_coordinator(coordinator_args());
  auto& standby = cluster.start_agent("standby", {});
  auto& worker = cluster.start_agent("worker", {"--exercise", "--leases", "1", "--lease-size",
                                                "1MiB", "--rounds", "0", "--interval", "20ms"});
  // A standby agent shows as warming until it has warmed up, then idle.
  auto standby_idle = [](const nlohmann::json& s) {
    for (const auto& a : s["agents"]) {
      if (a["name"] == "standby") return a["state"] == "idle";
    }
    return false;
  };
  ASSERT_TRUE(cluster.wait_for(
      [&](const auto& s) { return standby_idle(s) && leased_by(s, "worker") > 0; }, 5s))
      << cluster.status()->dump(2);
  first.signal(SIGTERM);
  auto rc = first.wait(5s);
  ASSERT_TRUE(rc);
  EXPECT_EQ(*rc, 0) << first.log();
  cluster.start_coordinator(coordinator_args());
  ASSERT_TRUE(cluster.wait_for(
      [](const auto& s) {
        return has_agent(s, "standby") && has_agent(s, "worker") && leased_by(s, "worker") > 0;
      },
      10s))
      << standby.log() << worker.log();
  // The agent prints after the coordinator has recorded it: wait for the line.
  EXPECT_TRUE(standby.wait_for_log("re-registered", 5s)) << standby.log();
  // The worker notices the loss in its verify loop, or, when the
  // coordinator went away during a lease request, in that request (which
  // the lease client retries): either way it leases again and goes on.
  EXPECT_TRUE(worker.wait_for_log("leases lost; acquiring again", 5s) ||
              worker.log().find("was lost with the coordinator session; retrying") !=
                  std::string::npos)
      << worker.log();
  EXPECT_TRUE(standby.running());
  EXPECT_TRUE(worker.running());
  worker.signal(SIGTERM);
  ASSERT_TRUE(worker.wait(5s));
  EXPECT_NE(worker.log().find("exercise passed"), std::string::npos) << worker.log();
}

TEST_F(HostCluster, RequestLargerThanPoolFailsAtOnce) {
  cluster.start_coordinator(coordinator_args());
  AgentSession session(session_options("big"));
  auto t0 = std::chrono::steady_clock::now();
  try {
    session.acquire(65ull << 20);
    FAIL() << "a lease larger than the pool was granted";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::TooLarge);
    EXPECT_NE(std::string(e.what()).find("can never fit"), std::string::npos) << e.what();
  }
  // The coordinator's default wait is 30 s: failing well before shows it was
  // not queued.
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 5s);
}

TEST_F(HostCluster, QueuedRequestIsGrantedWhenMemoryFrees) {
  cluster.start_coordinator(coordinator_args());
  AgentSession a(session_options("holder"));
  AgentSession b(session_options("waiter"));
  Lease big = a.acquire(60ull << 20);
  std::optional<Lease> got;
  std::chrono::steady_clock::duration waited{};
  std::thread t([&] {
    auto t0 = std::chrono::steady_clock::now();
    got = b.acquire(8ull << 20, LeaseEnd::High, 10s);
    waited = std::chrono::steady_clock::now() - t0;
  });
  ASSERT_TRUE(
      cluster.wait_for([](const auto& s) { return s["devices"][0]["pending_requests"] == 1; }, 5s));
  std::this_thread::sleep_for(100ms);
  a.release(big);
  t.join();
  ASSERT_TRUE(got && got->held());
  EXPECT_EQ(got->size(), 8ull << 20);
  EXPECT_GE(waited, 100ms);
  // The memory is real and usable.
  std::memset(got->data(), 0xAB, got->size());
}

TEST_F(HostCluster, QueuedRequestFailsAtItsDeadline) {
  cluster.start_coordinator(coordinator_args());
  AgentSession a(session_options("holder"));
  AgentSession b(session_options("waiter"));
  Lease big = a.acquire(60ull << 20);
  auto t0 = std::chrono::steady_clock::now();
  try {
    b.acquire(8ull << 20, LeaseEnd::Low, 300ms);
    FAIL() << "granted although the pool is full";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout);
    EXPECT_NE(std::string(e.what()).find("deadline"), std::string::npos) << e.what();
  }
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_GE(took, 300ms);
  EXPECT_LT(took, 5s);
  auto s = *cluster.status();
  EXPECT_EQ(s["devices"][0]["pending_requests"], 0);
  EXPECT_EQ(leased_by(s, "holder"), 60ull << 20) << "the holder's lease is untouched";
  // Fail-now requests are refused with NoSpace rather than queued.
  try {
    b.acquire(8ull << 20, LeaseEnd::Low, 0ms);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NoSpace);
  }
}

// SIGTERM reaches an agent blocked in a lease request that waits for
// memory: the wait is given up (the signal's EINTR is not an error) and the
// agent ends in order, exit status 0, its waiting request gone.
TEST_F(HostCluster, SigtermEndsAnAgentWaitingForMemoryCleanly) {
  auto& coordinator = cluster.start_coordinator(coordinator_args());
  AgentSession holder(session_options("holder"));
  Lease big = holder.acquire(60ull << 20);
  auto& waiter = cluster.start_agent(
      "waiter", {"--exercise", "--leases", "1", "--lease-size", "8MiB", "--rounds", "1"});
  ASSERT_TRUE(
      cluster.wait_for([](const auto& s) { return s["devices"][0]["pending_requests"] == 1; }, 10s))
      << waiter.log();
  waiter.signal(SIGTERM);
  auto rc = waiter.wait(10s);
  ASSERT_TRUE(rc) << "still waiting after SIGTERM: " << waiter.log();
  EXPECT_EQ(*rc, 0) << waiter.log();
  EXPECT_EQ(waiter.log().find("critical"), std::string::npos) << waiter.log();
  EXPECT_EQ(waiter.log().find("Interrupted system call"), std::string::npos) << waiter.log();
  EXPECT_NE(waiter.log().find("stopping"), std::string::npos) << waiter.log();
  EXPECT_TRUE(cluster.wait_for(
      [](const auto& s) {
        return s["devices"][0]["pending_requests"] == 0 && !has_agent(s, "waiter");
      },
      10s))
      << coordinator.log();
}

// The state folder holds every user's jobs and checkpoints: its user's
// alone (0700), whatever the umask the coordinator started under.
TEST_F(HostCluster, TheStateFolderIsItsUsersAloneWhateverTheUmask) {
  const mode_t before = ::umask(0);
  cluster.start_coordinator(coordinator_args());
  ::umask(before);
  for (const auto& [path, mode] : std::vector<std::pair<std::string, mode_t>>{
           {cluster.state_dir(), 0700},
           {cluster.state_dir() + "/checkpoints", 0700},
           {cluster.state_dir() + "/jobs.db", 0600},
           {cluster.state_dir() + "/coordinator.lock", 0600}}) {
    struct stat st {};
    ASSERT_EQ(::stat(path.c_str(), &st), 0) << path;
    EXPECT_EQ(st.st_mode & 0777, mode) << path;
  }
}

TEST_F(HostCluster, ResizeAndOwnership) {
  cluster.start_coordinator(coordinator_args());
  AgentSession a(session_options("owner"));
  Lease l = a.acquire(1ull << 20);
  a.resize(l, 3ull << 20);
  EXPECT_EQ(l.size(), 3ull << 20);
  EXPECT_EQ(l.generation(), 2u);
  std::memset(l.data(), 1, l.size());

  // Another registered agent may not release it.
  zmq::context_t ctx(1);
  Connection raw(ctx, cluster.endpoint(), "thief");
  auto reg = raw.request(
      [](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::Register,
                         proto::CreateRegister(fbb, fbb.CreateString("thief"), getpid()).Union()};
      },
      2s);
  raw.set_session(SessionToken{reg->body_as_RegisterAck()->session(),
                               reg->body_as_RegisterAck()->session_hi()});
  uint64_t id = l.id();
  auto r = raw.request(
      [id](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::LeaseRelease, proto::CreateLeaseRelease(fbb, id).Union()};
      },
      2s);
  ASSERT_EQ(r->body_type(), proto::Body::Error);
  EXPECT_EQ(r->body_as_Error()->code(), ErrorCode::NotOwner);
  EXPECT_EQ(leased_by(*cluster.status(), "owner"), 3ull << 20);
}

// Sends raw frames from a plain DEALER and returns the reply, if any.
std::optional<Reply> send_raw(zmq::socket_t& s, std::vector<zmq::const_buffer> frames) {
  for (size_t i = 0; i < frames.size(); ++i) {
    s.send(frames[i], i + 1 < frames.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  zmq::pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
  zmq::poll(&item, 1, std::chrono::milliseconds(2000));
  if (!(item.revents & ZMQ_POLLIN)) return std::nullopt;
  zmq::message_t msg;
  (void)s.recv(msg);
  AlignedBytes bytes(msg);
  auto d = decode(bytes.bytes());
  if (!std::holds_alternative<const proto::Envelope*>(d)) return std::nullopt;
  auto* env = std::get<const proto::Envelope*>(d);
  return Reply(std::move(bytes), env);
}

ErrorCode error_of(const std::optional<Reply>& r) {
  if (!r || r->envelope().body_type() != proto::Body::Error) return ErrorCode::None;
  return r->envelope().body_as_Error()->code();
}

TEST_F(HostCluster, MalformedMessagesGetErrorsAndChangeNothing) {
  auto& coordinator = cluster.start_coordinator(coordinator_args());
  AgentSession a(session_options("bystander"));
  Lease l = a.acquire(1ull << 20);

  zmq::context_t ctx(1);
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.connect(cluster.endpoint());

  std::string garbage = "this is not a flatbuffer";
  EXPECT_EQ(error_of(send_raw(s, {zmq::buffer(garbage)})), ErrorCode::Malformed);
  EXPECT_EQ(error_of(send_raw(s, {zmq::const_buffer(nullptr, 0)})), ErrorCode::Malformed);
  EXPECT_EQ(error_of(send_raw(s, {zmq::buffer(garbage), zmq::buffer(garbage)})),
            ErrorCode::Malformed);

  flatbuffers::FlatBufferBuilder fbb;
  finish_envelope(fbb, {5, "nobody", 0}, proto::Body::Heartbeat,
                  proto::CreateHeartbeat(fbb).Union());
  std::vector<uint8_t> hb(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
  auto unknown = send_raw(s, {zmq::buffer(hb)});
  EXPECT_EQ(error_of(unknown), ErrorCode::UnknownSender);
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->envelope().header()->request_id(), 5u) << "errors echo the request id";

  auto wrong_id = hb;
  wrong_id[4] = 'Z';
  EXPECT_EQ(error_of(send_raw(s, {zmq::buffer(wrong_id)})), ErrorCode::Malformed);
  std::vector<uint8_t> truncated(hb.begin(), hb.begin() + hb.size() / 2);
  EXPECT_EQ(error_of(send_raw(s, {zmq::buffer(truncated)})), ErrorCode::Malformed);

  flatbuffers::FlatBufferBuilder bad_name;
  finish_envelope(bad_name, {6, "x", 0}, proto::Body::Register,
                  proto::CreateRegister(bad_name, bad_name.CreateString("bad name!"), 1).Union());
  std::vector<uint8_t> reg(bad_name.GetBufferPointer(),
                           bad_name.GetBufferPointer() + bad_name.GetSize());
  EXPECT_EQ(error_of(send_raw(s, {zmq::buffer(reg)})), ErrorCode::InvalidArgument);

  // Random junk of many sizes, then one oversized message (ZeroMQ drops the
  // peer for it): the coordinator keeps serving everyone else.
  std::mt19937 rng(7);
  for (int i = 0; i < 300; ++i) {
    std::vector<uint8_t> junk(rng() % 300);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    s.send(zmq::buffer(junk), zmq::send_flags::none);
  }
  std::vector<uint8_t> huge(kMaxMessageBytes + 1024, 0x41);
  s.send(zmq::buffer(huge), zmq::send_flags::none);

  auto st = cluster.status(3s);
  ASSERT_TRUE(st) << "coordinator stopped answering:\n" << coordinator.log();
  EXPECT_TRUE(coordinator.running());
  EXPECT_EQ(leased_by(*st, "bystander"), 1ull << 20) << "existing leases are untouched";
  EXPECT_TRUE(a.connected());
  Lease more = a.acquire(1ull << 20);
  EXPECT_TRUE(more.held());
}

// A connection that keeps sending garbage is ignored after malformed_limit
// messages, and the log says so once per interval, not once per message.
TEST_F(HostCluster, APeerSendingGarbageIsIgnoredAndLoggedBriefly) {
  auto args = coordinator_args();
  args.insert(args.end(), {"--malformed-limit", "5"});
  auto& coordinator = cluster.start_coordinator(args);
  zmq::context_t ctx(1);
  zmq::socket_t s(ctx, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.connect(cluster.endpoint());
  std::string garbage = "this is not a flatbuffer";
  for (int i = 1; i <= 5; ++i) {
    auto r = send_raw(s, {zmq::buffer(garbage)});
    ASSERT_EQ(error_of(r), ErrorCode::Malformed) << i;
    const std::string text(str(r->envelope().body_as_Error()->message()));
    EXPECT_EQ(text.find("this connection is ignored") != std::string::npos, i == 5) << text;
  }
  for (int i = 0; i < 200; ++i) s.send(zmq::buffer(garbage), zmq::send_flags::none);
  flatbuffers::FlatBufferBuilder fbb;
  finish_envelope(fbb, {9, "cli", {}}, proto::Body::StatusRequest,
                  proto::CreateStatusRequest(fbb).Union());
  std::vector<uint8_t> status(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
  EXPECT_FALSE(send_raw(s, {zmq::buffer(status)})) << "an ignored connection gets nothing";
  EXPECT_TRUE(cluster.status(2s)) << "everyone else is served";
  size_t lines = 0;
  const std::string log = coordinator.log();
  for (size_t at = log.find("malformed messages"); at != std::string::npos;
       at = log.find("malformed messages", at + 1)) {
    ++lines;
  }
  EXPECT_LE(lines, 2u) << log;
}

TEST_F(HostCluster, ClientPrintsStatusAsJsonAndTable) {
  cluster.start_coordinator(coordinator_args());
  AgentSession a(session_options("cli-agent"));
  Lease l = a.acquire(2ull << 20, LeaseEnd::High);
  auto [rc, out] =
      cluster.run("leasehold", {"--endpoint", cluster.endpoint(), "status", "--output", "json"});
  ASSERT_EQ(rc, 0) << out;
  auto j = nlohmann::json::parse(out);
  EXPECT_EQ(j["devices"][0]["backend"], "host");
  EXPECT_EQ(j["devices"][0]["size_bytes"], 64ull << 20);
  EXPECT_EQ(j["devices"][0]["used_bytes"], 2ull << 20);
  ASSERT_EQ(j["agents"].size(), 1u);
  EXPECT_EQ(j["agents"][0]["name"], "cli-agent");
  EXPECT_EQ(j["agents"][0]["pid"], getpid());
  EXPECT_EQ(j["agents"][0]["leased_bytes"], 2ull << 20);
  ASSERT_EQ(j["leases"].size(), 1u);
  EXPECT_EQ(j["leases"][0]["id"], l.id());
  EXPECT_EQ(j["leases"][0]["agent"], "cli-agent");
  EXPECT_EQ(j["leases"][0]["offset"], (64ull << 20) - (2ull << 20));
  EXPECT_EQ(j["leases"][0]["size"], 2ull << 20);

  auto [rc2, table] = cluster.run("leasehold", {"--endpoint", cluster.endpoint(), "status"});
  EXPECT_EQ(rc2, 0);
  EXPECT_NE(table.find("cli-agent"), std::string::npos) << table;
  EXPECT_NE(table.find("occupancy"), std::string::npos) << table;
}

TEST_F(HostCluster, ClientFailsClearlyWithoutCoordinator) {
  auto [rc, out] = cluster.run("leasehold", {"--endpoint", cluster.endpoint(), "status"});
  EXPECT_NE(rc, 0);
  EXPECT_NE(out.find("no coordinator"), std::string::npos) << out;
  // A TCP endpoint nobody answers (with CURVE keys, which tcp:// needs): a
  // timeout, not a hang.
  const std::string key = cluster.dir() + "/key";
  ASSERT_EQ(cluster.run("leasehold", {"keygen", key}).first, 0);
  auto t0 = std::chrono::steady_clock::now();
  auto [rc2, out2] = cluster.run(
      "leasehold", {"--endpoint", "tcp://127.0.0.1:9", "--curve-key", key, "--curve-server-key",
                    key + ".pub", "--timeout", "300ms", "status"});
  EXPECT_NE(rc2, 0);
  EXPECT_NE(out2.find("no reply"), std::string::npos) << out2;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 10s);
}

TEST_F(HostCluster, SecondCoordinatorOnSameEndpointIsRefused) {
  cluster.start_coordinator(coordinator_args());
  auto args = coordinator_args();
  args.insert(args.begin(), {"--endpoint", cluster.endpoint()});
  auto [rc, out] = cluster.run("leasehold-coordinator", args);
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find("already serving"), std::string::npos) << out;
  EXPECT_TRUE(cluster.status()) << "the first coordinator keeps serving";
}

TEST_F(HostCluster, RestartAfterCrashReplacesStaleSockets) {
  auto& crashed = cluster.start_coordinator(coordinator_args());
  crashed.signal(SIGKILL);
  ASSERT_TRUE(crashed.wait(2s));
  auto& next = cluster.start_coordinator(coordinator_args());
  EXPECT_NE(next.log().find("stale"), std::string::npos) << next.log();
  AgentSession a(session_options("after-crash"));
  EXPECT_TRUE(a.acquire(1ull << 20).held());
}

// Asks the coordinator's chunk socket for `req` as whoever calls it; the
// refusal, or "" when descriptors came.
std::string ask_for_chunks(const std::string& socket, const ChunkRequest& req) {
  try {
    ChunkClient client(socket);
    client.fetch(req, [](uint64_t, std::vector<UniqueFd>, const ChunkGrant&) {});
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

// A lease's memory is its holder's alone: another session (here in the
// same process, with its own range) has nothing mapped there, cannot get
// the chunks under its own name or the holder's, and no other process can
// get them with the holder's own secret.
TEST_F(HostCluster, ALeaseIsReachableOnlyByItsHolder) {
  auto& coordinator = cluster.start_coordinator(coordinator_args());
  AgentSession holder(session_options("holder"));
  AgentSession intruder(session_options("intruder"));
  Lease lease = holder.acquire(1ull << 20);
  std::memset(lease.data(), 0x5a, lease.size());
  const uint64_t chunk = lease.offset() / holder.pool().alignment;
  const std::string socket = cluster.endpoint().substr(6) + ".chunks";

  // Nothing of it in the intruder's range: reading there faults.
  auto range = intruder.current_mapping();
  EXPECT_EQ(range->access(chunk), std::nullopt);
  EXPECT_TRUE(faults([&] {
              volatile auto* p = reinterpret_cast<volatile unsigned char*>(range->base() + lease.offset());
              (void)*p;
            }));

  // The chunk socket refuses every way round.
  ChunkRequest req;
  req.kind = ChunkRequest::Kind::Lease;
  req.lease_id = lease.id();
  req.agent = "intruder";
  req.session = SessionToken::random();  // it does not know its own token either way
  EXPECT_NE(ask_for_chunks(socket, req).find("not registered"), std::string::npos);
  req.agent = "holder";
  EXPECT_NE(ask_for_chunks(socket, req).find("not registered"), std::string::npos);
  // Even with the holder's secret (read from the holder's own process, as
  // a hostile program in it could), another process is refused: the
  // kernel names the asker.
  ASSERT_FALSE(holder.session_token().empty());
  req.session = holder.session_token();
  EXPECT_EQ(ask_for_chunks(socket, req), "") << "the holder itself may ask";
  const pid_t child = ::fork();
  if (child == 0) {
    const std::string why = ask_for_chunks(socket, req);
    ::_exit(why.find("is not agent 'holder'") != std::string::npos ? 0 : 1);
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "another process got the chunks";

  // The coordinator's own descriptors are out of reach of its user's other
  // processes (it is not dumpable); only root passes that rule.
  const std::string fd_dir = "/proc/" + std::to_string(coordinator.pid()) + "/fd";
  if (::geteuid() != 0) {
    EXPECT_EQ(::access(fd_dir.c_str(), R_OK), -1) << fd_dir << " is readable";
  }
  EXPECT_EQ(static_cast<unsigned char>(lease.data()[lease.size() - 1]), 0x5a);
}

// A region is written by its filler only, and by nobody once it is ready;
// every other attacher maps it read-only, and its descriptors too are
// read-only (mmap refuses to map them for writing).
TEST_F(HostCluster, ARegionIsReadOnlyForAllButItsFillerWhileItFills) {
  cluster.start_coordinator(coordinator_args());
  AgentSession filler(session_options("filler"));
  AgentSession reader(session_options("reader"));
  RegionAttachment mine = filler.attach_region("data/shared", 1ull << 20, true);
  ASSERT_TRUE(mine.must_fill());
  const uint64_t chunk = mine.offset() / filler.pool().alignment;
  EXPECT_EQ(filler.current_mapping()->access(chunk), Access::ReadWrite);
  std::memset(mine.data(), 0x42, mine.size());
  mine.mark_ready();
  EXPECT_EQ(filler.current_mapping()->access(chunk), Access::ReadOnly) << "ready: nobody writes";

  RegionAttachment theirs = reader.attach_region("data/shared", 1ull << 20, false);
  EXPECT_EQ(reader.current_mapping()->access(chunk), Access::ReadOnly);
  EXPECT_EQ(static_cast<unsigned char>(theirs.data()[12345]), 0x42) << "the filler's bytes";
  EXPECT_TRUE(faults([&] { *reinterpret_cast<volatile std::byte*>(theirs.data()) = std::byte{1}; }));
  EXPECT_TRUE(faults([&] { *reinterpret_cast<volatile std::byte*>(mine.data()) = std::byte{1}; }));

  // The descriptors the reader is handed cannot be mapped for writing.
  ChunkRequest req;
  req.kind = ChunkRequest::Kind::Region;
  req.region = "data/shared";
  req.agent = "reader";
  req.session = reader.session_token();
  ChunkClient client(cluster.endpoint().substr(6) + ".chunks");
  int refused = 0, fds = 0;
  const ChunkGrant grant = client.fetch(req, [&](uint64_t, std::vector<UniqueFd> got, const ChunkGrant&) {
    for (const auto& fd : got) {
      ++fds;
      void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
      if (p == MAP_FAILED && errno == EACCES) ++refused;
      if (p != MAP_FAILED) ::munmap(p, 4096);
    }
  });
  EXPECT_EQ(grant.access, Access::ReadOnly);
  EXPECT_GT(fds, 0);
  EXPECT_EQ(refused, fds);
  EXPECT_EQ(static_cast<unsigned char>(theirs.data()[0]), 0x42) << "nothing was written";
}

// Open descriptors of process `pid` (-1: none readable: the coordinator is
// not dumpable, so only root reads its /proc/PID/fd).
int open_descriptors(pid_t pid) {
  std::error_code ec;
  std::filesystem::directory_iterator it("/proc/" + std::to_string(pid) + "/fd", ec);
  if (ec) return -1;
  int n = 0;
  for (; it != std::filesystem::directory_iterator(); it.increment(ec)) ++n;
  return n;
}

// Every chunk handed out is a descriptor on both sides for a moment: after
// many grants and releases, and agents killed while they hold leases,
// neither side keeps one.
TEST_F(HostCluster, GrantsReleasesAndKilledAgentsLeakNoDescriptors) {
  auto& coordinator = cluster.start_coordinator(coordinator_args());
  AgentSession session(session_options("churn"));
  session.acquire(64u << 10).release();  // the chunk socket's connection, opened once
  const int ours = open_descriptors(::getpid());
  const int theirs = open_descriptors(coordinator.pid());
  for (int i = 0; i < 10000; ++i) {
    Lease lease = session.acquire((1 + i % 4) * (64u << 10));
    lease.data()[0] = std::byte{1};
    lease.release();
  }
  for (int round = 0; round < 10; ++round) {
    std::vector<Process*> doomed;
    for (int k = 0; k < 10; ++k) {
      const std::string name = "doomed-" + std::to_string(round) + "-" + std::to_string(k);
      doomed.push_back(&cluster.start_agent(
          name, {"--exercise", "--leases", "2", "--lease-size", "128KiB", "--rounds", "0",
                 "--interval", "20ms"}));
    }
    ASSERT_TRUE(cluster.wait_for(
        [&](const auto& s) {
          uint64_t leased = 0;
          for (int k = 0; k < 10; ++k) {
            leased += leased_by(s, "doomed-" + std::to_string(round) + "-" + std::to_string(k));
          }
          return leased == 10 * (256u << 10);
        },
        30s));
    for (Process* p : doomed) p->signal(SIGKILL);
    for (Process* p : doomed) ASSERT_TRUE(p->wait(10s));
  }
  ASSERT_TRUE(cluster.wait_for([](const auto& s) { return s["agents"].size() == 1; }, 30s));
  // ZeroMQ closes the status requests' sockets off its reaper thread: the
  // count settles, it does not have to be exact at once.
  EXPECT_TRUE(eventually([&] { return open_descriptors(::getpid()) <= ours; }, 10s))
      << open_descriptors(::getpid()) << " descriptors open here, " << ours
      << " at the start: the agent side kept some";
  if (theirs < 0) {
    GTEST_SKIP() << "the coordinator's descriptors are readable by root only (it is not "
                    "dumpable); the agent side was checked";
  }
  EXPECT_TRUE(eventually([&] { return open_descriptors(coordinator.pid()) == theirs; }, 10s))
      << open_descriptors(coordinator.pid()) << " descriptors open, " << theirs << " at the start";
}

TEST_F(HostCluster, BadOptionsAreRefusedWithTheirName) {
  auto [rc, out] = cluster.run("leasehold-coordinator",
                               {"--endpoint", cluster.endpoint(), "--pool-size", "12 parsecs"});
  EXPECT_EQ(rc, 2);
  EXPECT_NE(out.find("parsecs"), std::string::npos) << out;
  auto [rc2, out2] = cluster.run(
      "leasehold-coordinator",
      {"--endpoint", cluster.endpoint(), "--backend", "host", "--pool-size", "100000TiB"});
  EXPECT_EQ(rc2, 1);
  EXPECT_NE(out2.find("exceeds"), std::string::npos) << out2;
}

}  // namespace
}  // namespace leasehold::testing
