// The agent's side of the protocol against a scripted coordinator (a raw
// ROUTER socket in this process): the races a real coordinator can only
// produce by bad luck, produced here on purpose.
#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <map>
#include <mutex>
#include <thread>

#include <zmq.hpp>

#include "agent/job_channel.h"
#include "agent/job_worker.h"
#include "lease_client/session.h"
#include "shared/chunk_channel.h"
#include "shared/device.h"
#include "shared/job_spec.h"
#include "shared/protocol.h"

namespace leasehold::testing {
namespace {

using namespace std::chrono_literals;

// A coordinator that answers Register and Heartbeat, grants leases (late
// when told to), records releases and job reports, and pushes on demand.
class FakeCoordinator {
 public:
  explicit FakeCoordinator(const std::string& dir)
      : endpoint_("ipc://" + dir + "/fake.sock"),
        pool_(create_pool(Backend::Host, 0, 8ull << 20, 1ull << 20)),
        router_(ctx_, zmq::socket_type::router) {
    router_.set(zmq::sockopt::linger, 0);
    router_.bind(endpoint_);
    // Any lease it granted, whole, from offset 0 (its leases overlap).
    chunks_ = std::make_unique<ChunkServer>(
        dir + "/fake.chunks", nullptr, [this](const ChunkRequest& req, pid_t, uid_t) {
          ChunkServer::Decision d;
          auto it = lease_sizes_.find(req.lease_id);
          if (req.kind != ChunkRequest::Kind::Lease || it == lease_sizes_.end()) {
            d.refusal = "no such lease";
            return d;
          }
          const uint64_t chunk = pool_->descriptor().alignment;
          d.grant = ChunkGrant{0, 0, (it->second + chunk - 1) / chunk, Access::ReadWrite};
          d.pool = pool_.get();
          return d;
        });
    thread_ = std::thread([this] { loop(); });
  }
  ~FakeCoordinator() {
    stop_.store(true);
    thread_.join();
  }
  const std::string& endpoint() const { return endpoint_; }

  std::atomic<int> grant_delay_ms{0};  // lease grants wait this long
  std::atomic<int> unanswered_updates{0};  // this many JobUpdates get no reply
  std::atomic<bool> chunk_socket_gone{false};  // RegisterAcks name a chunk socket that is gone
  std::atomic<int> registrations{0};
  std::atomic<bool> forget_lessees{false};  // answer lease requests as a restarted coordinator
  std::atomic<bool> forget_sessions{false};  // answer heartbeats as a restarted coordinator
  std::atomic<bool> silent{false};           // answer nothing (a stopped coordinator)
  std::atomic<uint32_t> silence_limit_ms{0};  // in RegisterAck (0: not said)
  // The instance it answers as (RegisterAck, HeartbeatAck): another one
  // means a restarted coordinator.
  std::atomic<uint64_t> instance{5};
  std::atomic<int> stale_holds{-1};  // as the latest Register or Heartbeat said

  struct Report {
    uint64_t job;
    uint32_t attempt;
    std::string state, reason;
  };
  std::vector<uint64_t> released() {
    std::lock_guard lock(mu_);
    return released_;
  }
  std::vector<Report> reports() {
    std::lock_guard lock(mu_);
    return reports_;
  }
  // ShrinkDone answers: (shrink id, reason).
  std::vector<std::pair<uint64_t, std::string>> shrink_answers() {
    std::lock_guard lock(mu_);
    return shrink_answers_;
  }
  // Jobs listed in the latest heartbeat: job id -> phase.
  std::map<uint64_t, proto::JobPhase> listed() {
    std::lock_guard lock(mu_);
    return listed_;
  }
  int heartbeats() { return heartbeats_.load(); }
  // Pushes `body` to every socket the agent used.
  void push(proto::Body type, const std::function<flatbuffers::Offset<void>(
                                  flatbuffers::FlatBufferBuilder&)>& build) {
    std::lock_guard lock(mu_);
    pushes_.push_back({type, build});
  }

 private:
  struct Pending {
    std::string rid;
    uint64_t request_id;
    uint64_t size;
    std::chrono::steady_clock::time_point due;
  };
  using Build = std::function<flatbuffers::Offset<void>(flatbuffers::FlatBufferBuilder&)>;

  void send(const std::string& rid, uint64_t req, proto::Body type, const Build& build) {
    flatbuffers::FlatBufferBuilder fbb;
    auto body = build(fbb);
    finish_envelope(fbb, {req, "coordinator", {}}, type, body);
    router_.send(zmq::buffer(rid), zmq::send_flags::sndmore);
    router_.send(to_message(fbb), zmq::send_flags::none);
  }

  void loop() {
    while (!stop_.load()) {
      std::vector<zmq::pollitem_t> items = {{router_.handle(), 0, ZMQ_POLLIN, 0},
                                            {nullptr, chunks_->listen_fd(), ZMQ_POLLIN, 0}};
      for (int fd : chunks_->connections()) items.push_back({nullptr, fd, ZMQ_POLLIN, 0});
      zmq::poll(items.data(), items.size(), 10ms);
      if (items[1].revents & ZMQ_POLLIN) chunks_->accept_pending();
      for (size_t i = 2; i < items.size(); ++i) {
        if (items[i].revents) chunks_->serve(items[i].fd);
      }
      const auto& item = items[0];
      if (item.revents & ZMQ_POLLIN) {
        zmq::message_t rid, payload;
        (void)router_.recv(rid);
        (void)router_.recv(payload);
        AlignedBytes bytes(payload);
        auto decoded = decode(bytes.bytes());
        if (auto* env = std::get_if<const proto::Envelope*>(&decoded)) {
          serve(rid.to_string(), **env);
        }
      }
      auto now = std::chrono::steady_clock::now();
      for (auto it = late_.begin(); it != late_.end();) {
        if (it->due <= now) {
          grant(it->rid, it->request_id, it->size);
          it = late_.erase(it);
        } else {
          ++it;
        }
      }
      std::vector<std::pair<proto::Body, Build>> pushes;
      {
        std::lock_guard lock(mu_);
        pushes.swap(pushes_);
      }
      for (const auto& [type, build] : pushes) {
        for (const auto& rid : agent_rids_) send(rid, 0, type, build);
      }
    }
  }

  void grant(const std::string& rid, uint64_t req, uint64_t size) {
    uint64_t id = next_lease_++;
    lease_sizes_[id] = size;
    send(rid, req, proto::Body::LeaseGrant, [&](auto& fbb) {
      auto lease = proto::CreateLease(fbb, id, fbb.CreateString("agent"), 0, size);
      return proto::CreateLeaseGrant(fbb, lease).Union();
    });
  }

  void serve(const std::string& rid, const proto::Envelope& env) {
    if (silent.load()) return;
    uint64_t req = env.header()->request_id();
    agent_rids_.insert(rid);
    auto ack = [&] {
      send(rid, req, proto::Body::Ack, [](auto& fbb) { return proto::CreateAck(fbb).Union(); });
    };
    switch (env.body_type()) {
      case proto::Body::Register: {
        const auto& d = pool_->descriptor();
        ++registrations;
        stale_holds = static_cast<int>(env.body_as_Register()->stale_holds());
        // A coordinator that died right after answering took its chunk
        // socket along.
        const std::string socket =
            chunk_socket_gone.load() ? chunks_->path() + ".gone" : chunks_->path();
        send(rid, req, proto::Body::RegisterAck, [&](auto& fbb) {
          auto info = proto::CreatePoolInfo(fbb, proto::Backend::Host, 0,
                                            fbb.CreateString(d.device_name), d.size, d.alignment,
                                            d.epoch);
          return proto::CreateRegisterAck(fbb, 42, 100, info, 1000, 0, 0, silence_limit_ms.load(),
                                          instance.load(), 0, fbb.CreateString(socket))
              .Union();
        });
        break;
      }
      case proto::Body::Heartbeat: {
        stale_holds = static_cast<int>(env.body_as_Heartbeat()->stale_holds());
        if (forget_sessions.load()) {
          send(rid, req, proto::Body::Error, [](auto& fbb) {
            return proto::CreateError(fbb, ErrorCode::UnknownSender,
                                      fbb.CreateString("agent 'agent' is not registered"))
                .Union();
          });
          break;
        }
        std::map<uint64_t, proto::JobPhase> listed;
        if (const auto* jobs = env.body_as_Heartbeat()->jobs()) {
          for (const auto* j : *jobs) listed[j->job_id()] = j->phase();
        }
        {
          std::lock_guard lock(mu_);
          listed_ = listed;
        }
        ++heartbeats_;
        send(rid, req, proto::Body::HeartbeatAck,
             [&](auto& fbb) { return proto::CreateHeartbeatAck(fbb, instance.load()).Union(); });
        break;
      }
      case proto::Body::LeaseRequest: {
        if (forget_lessees.load()) {
          send(rid, req, proto::Body::Error, [](auto& fbb) {
            return proto::CreateError(fbb, ErrorCode::UnknownSender,
                                      fbb.CreateString("agent 'agent' is not registered"))
                .Union();
          });
          break;
        }
        uint64_t size = env.body_as_LeaseRequest()->size();
        if (grant_delay_ms.load() > 0) {
          late_.push_back({rid, req, size,
                           std::chrono::steady_clock::now() +
                               std::chrono::milliseconds(grant_delay_ms.load())});
        } else {
          grant(rid, req, size);
        }
        break;
      }
      case proto::Body::LeaseRelease: {
        std::lock_guard lock(mu_);
        released_.push_back(env.body_as_LeaseRelease()->lease_id());
        ack();
        break;
      }
      case proto::Body::JobUpdate: {
        const auto* u = env.body_as_JobUpdate();
        {
          std::lock_guard lock(mu_);
          reports_.push_back({u->job_id(), u->attempt(), job_status_name(u->status()),
                              std::string(str(u->reason()))});
        }
        if (unanswered_updates.load() > 0) {
          --unanswered_updates;  // lost on the way: the agent must send it again
        } else {
          ack();
        }
        break;
      }
      case proto::Body::ShrinkDone: {
        const auto* d = env.body_as_ShrinkDone();
        {
          std::lock_guard lock(mu_);
          shrink_answers_.emplace_back(d->id(), std::string(str(d->reason())));
        }
        ack();
        break;
      }
      default:
        ack();
    }
  }

  std::string endpoint_;
  std::unique_ptr<DevicePool> pool_;
  std::unique_ptr<ChunkServer> chunks_;
  std::map<uint64_t, uint64_t> lease_sizes_;  // granted: id -> size (loop thread only)
  zmq::context_t ctx_{1};
  zmq::socket_t router_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> heartbeats_{0};
  std::set<std::string> agent_rids_;  // loop thread only
  std::vector<Pending> late_;         // loop thread only
  uint64_t next_lease_ = 77;          // loop thread only
  std::mutex mu_;
  std::vector<uint64_t> released_;
  std::vector<Report> reports_;
  std::vector<std::pair<uint64_t, std::string>> shrink_answers_;
  std::map<uint64_t, proto::JobPhase> listed_;
  std::vector<std::pair<proto::Body, Build>> pushes_;
};

class AgentProtocol : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/leasehold-agentproto-XXXXXX";
    ASSERT_TRUE(mkdtemp(tmpl));
    dir = tmpl;
    fake = std::make_unique<FakeCoordinator>(dir);
  }
  void TearDown() override {
    fake.reset();
    std::filesystem::remove_all(dir);
  }
  AgentOptions options() const {
    AgentOptions o;
    o.endpoint = fake->endpoint();
    o.name = "agent";
    o.request_timeout = 300ms;
    return o;
  }
  template <class Pred>
  bool eventually(Pred pred, std::chrono::milliseconds timeout = 10s) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (pred()) return true;
      std::this_thread::sleep_for(10ms);
    }
    return pred();
  }
  std::string dir;
  std::unique_ptr<FakeCoordinator> fake;
};

// The memory of a grant comes over the chunk socket: when that is gone
// (the coordinator died after answering), the lease is refused with the
// reason and given back, not kept unmapped.
TEST_F(AgentProtocol, ALeaseWhoseChunksCannotBeFetchedIsGivenBack) {
  fake->chunk_socket_gone = true;
  AgentSession session(options());
  try {
    session.acquire(1u << 20);
    FAIL() << "a lease without its memory was handed out";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("chunk socket"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(eventually([&] { return fake->released().size() == 1; }, 5s));
  // With the socket back (the next registration names it), leases map.
  fake->chunk_socket_gone = false;
}

// A lease's memory is mapped into the session's process; released, it is
// out of its reach again.
TEST_F(AgentProtocol, ALeaseIsMappedWhileHeldAndUnmappedWhenReleased) {
  AgentSession session(options());
  Lease lease = session.acquire(2u << 20);
  auto* bytes = reinterpret_cast<volatile unsigned char*>(lease.data());
  bytes[0] = 0x5a;
  bytes[lease.size() - 1] = 0xa5;
  EXPECT_EQ(bytes[0], 0x5a);
  auto mapping = session.current_mapping();
  const uint64_t first = lease.offset() / mapping->descriptor().alignment;
  EXPECT_EQ(mapping->access(first), Access::ReadWrite);
  lease.release();
  EXPECT_EQ(mapping->access(first), std::nullopt);
}

// A coordinator that restarted answers the old token with UnknownSender: the
// session is lost at once, before the caller sees the error, so a job thread
// never takes it for a refused lease ("out of memory") while the heartbeat
// thread has not noticed yet.
TEST_F(AgentProtocol, AnUnknownSenderAnswerEndsTheSessionBeforeTheCallerSeesIt) {
  AgentSession session(options());
  std::atomic<int> lost{0};
  session.set_session_listener([&](const std::string& why) {
    if (!why.empty()) ++lost;
  });
  fake->forget_lessees = true;
  try {
    session.acquire(1 << 20, LeaseEnd::Low, 0ms);
    FAIL() << "granted by a coordinator that does not know us";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::UnknownSender) << e.what();
    EXPECT_EQ(lost.load(), 1) << "the listener heard of the loss before the error arrived";
  }
  fake->forget_lessees = false;
  EXPECT_TRUE(eventually([&] { return session.registrations() >= 2 && session.connected(); }))
      << "and it registers again";
  session.set_session_listener({});
}

// The self-fence: an agent whose coordinator stops answering stops touching
// leased memory (may_touch) strictly before the coordinator's silence limit,
// measured from the last message the coordinator answered. Silence alone
// ends nothing (the coordinator may be paused): the session holds until an
// answer comes from another instance of the coordinator, a restart.
TEST_F(AgentProtocol, AnAgentStopsTouchingLeasesInASilenceAndLosesThemOnlyToARestart) {
  AgentSession session(options());
  Lease lease = session.acquire(1 << 20);
  ASSERT_TRUE(session.may_touch());
  fake->silent = true;
  const auto silenced = std::chrono::steady_clock::now();
  // The silence limit here is two heartbeats (200 ms) from the last answer,
  // which came before the silence: untouchable well within it (generously).
  ASSERT_TRUE(eventually([&] { return !session.may_touch(); }, 10s));
  EXPECT_LT(std::chrono::steady_clock::now() - silenced, 2s);
  std::this_thread::sleep_for(1500ms);  // many times the limit
  EXPECT_TRUE(session.connected()) << "a silence is not a restart";
  EXPECT_FALSE(session.may_touch());
  EXPECT_FALSE(lease.lost());
  // The coordinator answers again, but it is another instance.
  fake->instance = 6;
  fake->silent = false;
  ASSERT_TRUE(eventually([&] { return session.registrations() == 2; }, 10s));
  EXPECT_TRUE(lease.lost());
  EXPECT_TRUE(session.may_touch()) << "registered with the new instance";
}

// A short silence, within the coordinator's limit: the agent pauses (may
// not touch) and goes on once the coordinator answers again, same session.
TEST_F(AgentProtocol, AnAgentPausedBySilenceGoesOnWhenTheCoordinatorAnswersAgain) {
  fake->silence_limit_ms = 6000;  // the agent's own deadline: 4.5 s
  AgentSession session(options());
  Lease lease = session.acquire(1 << 20);
  fake->silent = true;
  ASSERT_TRUE(eventually([&] { return !session.may_touch(); }, 10s));
  EXPECT_TRUE(session.connected()) << "paused, not lost";
  fake->silent = false;
  EXPECT_TRUE(session.wait_may_touch([] { return false; }));
  EXPECT_TRUE(session.may_touch());
  EXPECT_FALSE(lease.lost());
  EXPECT_EQ(session.registrations(), 1u);
}

// Leases of a lost session still held are reported in the next Register and
// every Heartbeat, until they are let go: the coordinator keeps them fenced.
TEST_F(AgentProtocol, LeasesHeldFromALostSessionAreReportedUntilLetGo) {
  AgentSession session(options());
  Lease lease = session.acquire(1 << 20);
  EXPECT_TRUE(eventually([&] { return fake->stale_holds.load() == 0; }));
  fake->forget_sessions = true;
  ASSERT_TRUE(eventually([&] { return !session.connected(); }));
  fake->forget_sessions = false;
  ASSERT_TRUE(eventually([&] { return session.connected(); }));
  EXPECT_EQ(fake->stale_holds.load(), 1) << "the Register says one lease is still held";
  EXPECT_TRUE(lease.lost());
  Lease moved = std::move(lease);  // moving does not count it twice
  EXPECT_TRUE(eventually([&] { return fake->stale_holds.load() == 1; }));
  moved = Lease();
  EXPECT_TRUE(eventually([&] { return fake->stale_holds.load() == 0; }))
      << "a heartbeat says it was let go";
}

TEST_F(AgentProtocol, ALeaseGrantedAfterItsRequestGaveUpIsReleased) {
  AgentSession session(options());
  fake->grant_delay_ms = 700;
  try {
    session.acquire(1 << 20, LeaseEnd::Low, 0ms);
    FAIL() << "the request should have timed out";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Timeout) << e.what();
  }
  // Nothing else uses the control socket: the session notices the late
  // grant by itself and gives the lease back.
  EXPECT_TRUE(eventually([&] { return !fake->released().empty(); }))
      << "lease 77 leaked until the agent exits";
  EXPECT_EQ(fake->released(), std::vector<uint64_t>{77});
}

TEST_F(AgentProtocol, AStopBeforeItsAssignmentIsAnsweredAndTheAssignmentIgnored) {
  AgentSession session(options());
  JobWorker worker(session);  // after the session: destroyed first
  std::atomic<bool> stop{false};
  std::thread runner([&] { worker.run(stop); });

  fake->push(proto::Body::StopJob, [](auto& fbb) {
    return proto::CreateStopJob(fbb, 5, 1, true, fbb.CreateString("cancelled by request")).Union();
  });
  ASSERT_TRUE(eventually([&] { return !fake->reports().empty(); }));
  auto r = fake->reports()[0];
  EXPECT_EQ(r.job, 5u);
  EXPECT_EQ(r.attempt, 1u);
  EXPECT_EQ(r.state, "cancelled");
  EXPECT_EQ(r.reason, "cancelled before it started");

  // The assignment arrives late: ignored, never started.
  auto spec = std::make_shared<proto::JobSpecT>();
  spec->name = "late";
  spec->epochs = 1;
  fake->push(proto::Body::AssignJob, [spec](auto& fbb) {
    return proto::CreateAssignJob(fbb, 5, proto::JobSpec::Pack(fbb, spec.get()), 1).Union();
  });
  int beats = fake->heartbeats();
  ASSERT_TRUE(eventually([&] { return fake->heartbeats() >= beats + 3; }));
  EXPECT_TRUE(fake->listed().empty()) << "job 5 must not run";
  EXPECT_EQ(fake->reports().size(), 1u);

  // A new assignment is taken (and fails here at once: no dataset).
  fake->push(proto::Body::AssignJob, [spec](auto& fbb) {
    return proto::CreateAssignJob(fbb, 6, proto::JobSpec::Pack(fbb, spec.get()), 1).Union();
  });
  ASSERT_TRUE(eventually([&] { return fake->reports().size() >= 2; }));
  EXPECT_EQ(fake->reports()[1].job, 6u);
  EXPECT_EQ(fake->reports()[1].state, "failed");
  EXPECT_NE(fake->reports()[1].reason.find("dataset"), std::string::npos)
      << fake->reports()[1].reason;
  stop.store(true);
  runner.join();
}

// The session hands the pushes it does not handle itself to the agent's
// JobChannel (agent/job_channel.h): an assignment with its program job's
// token, a stop; and its jobs provider fills every heartbeat.
TEST_F(AgentProtocol, TheJobChannelTakesAssignmentsAndStopsAndListsTheJobs) {
  AgentSession session(options());
  JobChannel jobs(session);  // after the session: destroyed first
  std::mutex mu;
  std::vector<JobAssignment> assigned;
  std::vector<std::pair<uint64_t, std::string>> stopped;
  jobs.set_handlers(
      [&](JobAssignment a) {
        std::lock_guard lock(mu);
        assigned.push_back(std::move(a));
      },
      [&](uint64_t id, uint32_t, bool, const std::string& why) {
        std::lock_guard lock(mu);
        stopped.emplace_back(id, why);
      },
      [] {
        proto::AgentJobT j;
        j.job_id = 11;
        j.attempt = 2;
        j.phase = proto::JobPhase::Running;
        return std::vector<proto::AgentJobT>{j};
      });
  auto spec = std::make_shared<proto::JobSpecT>();
  spec->name = "program";
  fake->push(proto::Body::AssignJob, [spec](auto& fbb) {
    return proto::CreateAssignJob(fbb, 11, proto::JobSpec::Pack(fbb, spec.get()), 2, true, 1234,
                                  0xff, 0x0123456789abcdefull)
        .Union();
  });
  ASSERT_TRUE(eventually([&] {
    std::lock_guard lock(mu);
    return !assigned.empty();
  }));
  {
    std::lock_guard lock(mu);
    const JobAssignment& a = assigned[0];
    EXPECT_EQ(a.job_id, 11u);
    EXPECT_EQ(a.attempt, 2u);
    EXPECT_EQ(a.job_token, "0123456789abcdef00000000000000ff");
    EXPECT_TRUE(a.checkpoint_owner.private_folder);
    EXPECT_EQ(a.checkpoint_owner.uid, 1234);
    EXPECT_EQ(verify_job(a.spec)->name()->str(), "program");
  }
  EXPECT_TRUE(eventually([&] {
    auto l = fake->listed();
    return l.count(11) && l[11] == proto::JobPhase::Running;
  }));
  fake->push(proto::Body::StopJob, [](auto& fbb) {
    return proto::CreateStopJob(fbb, 11, 2, false, fbb.CreateString("moved")).Union();
  });
  ASSERT_TRUE(eventually([&] {
    std::lock_guard lock(mu);
    return !stopped.empty();
  }));
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(stopped[0], (std::pair<uint64_t, std::string>{11, "moved"}));
  }
  // No token (a model job): empty.
  EXPECT_EQ(JobChannel::token_text(0, 0), "");
}

TEST_F(AgentProtocol, AShrinkForAnotherAgentOrSessionIsRefusedAndOneForNoJobIsAnswered) {
  AgentOptions o = options();
  AgentSession session(o);
  JobWorker worker(session);
  std::atomic<bool> stop{false};
  std::thread runner([&] { worker.run(stop); });
  auto shrink = [&](uint64_t id, const std::string& agent, uint64_t session_token) {
    fake->push(proto::Body::Shrink, [=](auto& fbb) {
      return proto::CreateShrink(fbb, id, fbb.CreateString(agent), session_token, 9, 1ull << 20,
                                 1000)
          .Union();
    });
  };
  shrink(1, "someone-else", 42);  // the fake's session token is 42
  shrink(2, o.name, 41);          // an earlier session
  shrink(3, o.name, 42);
  ASSERT_TRUE(eventually([&] { return !fake->shrink_answers().empty(); }));
  int beats = fake->heartbeats();
  ASSERT_TRUE(eventually([&] { return fake->heartbeats() >= beats + 3; }));
  auto answers = fake->shrink_answers();
  ASSERT_EQ(answers.size(), 1u) << "only the Shrink addressed to this agent and session";
  EXPECT_EQ(answers[0].first, 3u);
  EXPECT_EQ(answers[0].second, "job 9 is not running on this agent");
  stop.store(true);
  runner.join();
}

TEST_F(AgentProtocol, AFinalReportIsSentAgainUntilAcknowledgedAndListedMeanwhile) {
  AgentSession session(options());
  JobWorker worker(session);
  std::atomic<bool> stop{false};
  std::thread runner([&] { worker.run(stop); });
  fake->unanswered_updates = 2;
  fake->push(proto::Body::StopJob, [](auto& fbb) {
    return proto::CreateStopJob(fbb, 8, 3, true, fbb.CreateString("cancelled by request")).Union();
  });
  ASSERT_TRUE(eventually([&] { return !fake->reports().empty(); }));
  EXPECT_TRUE(eventually([&] {
    auto l = fake->listed();
    return l.count(8) && l[8] == proto::JobPhase::Reporting;
  })) << "an unacknowledged final report is listed in the heartbeats";
  ASSERT_TRUE(eventually([&] { return fake->reports().size() >= 3; }));
  for (const auto& r : fake->reports()) {
    EXPECT_EQ(r.job, 8u);
    EXPECT_EQ(r.state, "cancelled");
  }
  EXPECT_TRUE(eventually([&] { return fake->listed().empty(); })) << "acknowledged at last";
  int sent = static_cast<int>(fake->reports().size());
  std::this_thread::sleep_for(500ms);
  EXPECT_EQ(static_cast<int>(fake->reports().size()), sent) << "not sent again once acknowledged";
  stop.store(true);
  runner.join();
}

}  // namespace
}  // namespace leasehold::testing
