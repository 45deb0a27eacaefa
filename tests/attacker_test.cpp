// A local attacker with a raw ZeroMQ socket and the public `leasehold status`
// output, against a coordinator serving victims: an exercise agent keeping
// a verification pattern in two leases, and a job agent running a user's
// long job. Each attack of the trust-boundary issue is tried with real
// processes on the host backend; each must fail with the right error while
// the victims' leases, job and patterns stay as they were.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shared/connection.h"
#include "shared/job_spec.h"
#include "shared/session_token.h"
#include "tests/support/cluster.h"
#include "tests/support/synthetic_data.h"

namespace leasehold::testing {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;

constexpr auto kTimeout = 3s;

ErrorCode code_of(const Reply& r) {
  return r->body_type() == proto::Body::Error ? r->body_as_Error()->code() : ErrorCode::None;
}
std::string message_of(const Reply& r) {
  return r->body_type() == proto::Body::Error ? std::string(str(r->body_as_Error()->message()))
                                              : std::string();
}

// The attacker: a raw connection that may claim any name and any token.
class Attacker {
 public:
  Attacker(const std::string& endpoint, const std::string& name)
      : conn_(ctx_, endpoint, name) {}

  Reply send(const Connection::BodyBuilder& build, SessionToken token = {}) {
    conn_.set_session(token);
    return conn_.request(build, kTimeout);
  }
  // Registers under `name` (sender) as `pid`; the reply as it came.
  Reply register_as(const std::string& name, int pid, bool takes_jobs) {
    return send([&](flatbuffers::FlatBufferBuilder& fbb) {
      return std::pair{proto::Body::Register,
                       proto::CreateRegister(fbb, fbb.CreateString(name), pid, -1, 0, takes_jobs)
                           .Union()};
    });
  }
  static SessionToken token_of(const Reply& ack) {
    const auto* a = ack->body_as_RegisterAck();
    return a ? SessionToken{a->session(), a->session_hi()} : SessionToken{};
  }
  Connection& connection() { return conn_; }

 private:
  zmq::context_t ctx_{1};
  Connection conn_;
};

Connection::BodyBuilder release(uint64_t lease) {
  return [lease](flatbuffers::FlatBufferBuilder& fbb) {
    return std::pair{proto::Body::LeaseRelease, proto::CreateLeaseRelease(fbb, lease).Union()};
  };
}
Connection::BodyBuilder resize(uint64_t lease, uint64_t size) {
  return [=](flatbuffers::FlatBufferBuilder& fbb) {
    return std::pair{proto::Body::LeaseResize, proto::CreateLeaseResize(fbb, lease, size).Union()};
  };
}
Connection::BodyBuilder heartbeat() {
  return [](flatbuffers::FlatBufferBuilder& fbb) {
    return std::pair{proto::Body::Heartbeat, proto::CreateHeartbeat(fbb).Union()};
  };
}
// A heartbeat saying the sender runs `job` (acknowledging it).
Connection::BodyBuilder heartbeat_running(uint64_t job, uint32_t attempt) {
  return [=](flatbuffers::FlatBufferBuilder& fbb) {
    std::vector<flatbuffers::Offset<proto::AgentJob>> jobs{
        proto::CreateAgentJob(fbb, job, attempt, proto::JobPhase::Running)};
    return std::pair{proto::Body::Heartbeat,
                     proto::CreateHeartbeat(fbb, fbb.CreateVector(jobs)).Union()};
  };
}
// Every other message an agent sends after registering.
std::vector<std::pair<std::string, Connection::BodyBuilder>> agent_messages() {
  return {{"LeaseRequest",
           [](flatbuffers::FlatBufferBuilder& fbb) {
             return std::pair{proto::Body::LeaseRequest,
                              proto::CreateLeaseRequest(fbb, 1u << 20, proto::LeaseEnd::Low, 0)
                                  .Union()};
           }},
          {"ShrinkDone",
           [](flatbuffers::FlatBufferBuilder& fbb) {
             return std::pair{proto::Body::ShrinkDone, proto::CreateShrinkDone(fbb, 1, 0).Union()};
           }},
          {"AttachRegion",
           [](flatbuffers::FlatBufferBuilder& fbb) {
             return std::pair{proto::Body::AttachRegion,
                              proto::CreateAttachRegion(fbb, fbb.CreateString("dataset/x"), 1u << 20,
                                                        true)
                                  .Union()};
           }},
          {"Unregister", [](flatbuffers::FlatBufferBuilder& fbb) {
             return std::pair{proto::Body::Unregister, proto::CreateUnregister(fbb).Union()};
           }}};
}
// "The job succeeded at 99.9%": what the attacker sent.
Connection::BodyBuilder forged_success(uint64_t job, uint32_t attempt) {
  return [=](flatbuffers::FlatBufferBuilder& fbb) {
    proto::JobUpdateT u;
    u.job_id = job;
    u.attempt = attempt;
    u.status = proto::JobStatus::Succeeded;
    u.test_accuracy = 0.999;
    return std::pair{proto::Body::JobUpdate, proto::JobUpdate::Pack(fbb, &u).Union()};
  };
}
Connection::BodyBuilder submit(const proto::JobSpecT& spec) {
  return [&spec](flatbuffers::FlatBufferBuilder& fbb) {
    proto::SubmitJobT s;
    s.spec = std::make_unique<proto::JobSpecT>(spec);
    return std::pair{proto::Body::SubmitJob, proto::SubmitJob::Pack(fbb, &s).Union()};
  };
}

class Attack : public ::testing::Test {
 protected:
  void SetUp() override {
    write_synthetic_idx(c.dir(), "train", 600, 1);
    write_synthetic_idx(c.dir(), "test", 150, 2);
    coordinator_ = &c.start_coordinator({"--backend", "host", "--pool-size", "64MiB",
                                         "--alignment", "1MiB", "--queued-per-user", "3",
                                         "--assign-timeout", "3s", "--stop-timeout", "3s",
                                         "--lease-wait-timeout", "500ms"});
    pattern_ = &c.start_agent("victim", {"--exercise", "--leases", "2", "--lease-size", "4MiB",
                                         "--rounds", "0", "--interval", "20ms"});
    c.start_agent("worker", {});
    ASSERT_TRUE(c.wait_for(
        [](const nlohmann::json& s) { return leased_by(s, "victim") == 8u << 20 && idle_agents(s) == 1; },
        20s));
    auto [rc, out] = client({"submit", job_file("victims-job", 100000)});
    ASSERT_EQ(rc, 0) << out;
    ASSERT_TRUE(c.wait_for([](const nlohmann::json& s) { return leased_by(s, "worker") > 0; }, 20s));
    before_ = *c.status();
    ASSERT_EQ(job()["state"], "running");
  }

  std::string job_file(const std::string& name, int epochs) {
    const std::string path = c.dir() + "/" + name + ".json";
    // A small budget: the pool is 64 MiB and the victim holds 8 of it.
    std::ofstream(path) << synthetic_job_json(
        c.dir(), name,
        ", \"epochs\": " + std::to_string(epochs) + ", \"memory_budget\": \"16MiB\"");
    return path;
  }
  // A job spec as a raw client would send it (no client-side checks).
  proto::JobSpecT spec(const std::string& name) {
    std::ifstream in(job_file("template", 1));
    std::string json((std::istreambuf_iterator<char>(in)), {});
    auto buffer = parse_job_json(json, "template.json");
    proto::JobSpecT s;
    verify_job(buffer)->UnPackTo(&s);
    s.name = name;
    return s;
  }
  std::pair<int, std::string> client(std::vector<std::string> args) {
    args.insert(args.begin(), {"--endpoint", c.endpoint()});
    return c.run("leasehold", args);
  }
  nlohmann::json job(uint64_t id = 1) {
    auto [rc, out] = client({"job", std::to_string(id), "-o", "json"});
    EXPECT_EQ(rc, 0) << out;
    return rc == 0 ? nlohmann::json::parse(out) : nlohmann::json();
  }
  std::vector<uint64_t> victim_leases() {
    std::vector<uint64_t> ids;
    for (const auto& l : before_["leases"]) {
      if (l["agent"] == "victim") ids.push_back(l["id"]);
    }
    return ids;
  }
  int pid_of(const std::string& agent) {
    for (const auto& a : before_["agents"]) {
      if (a["name"] == agent) return a["pid"];
    }
    return 0;
  }

  // What every attack must leave as it was: the victims' leases (same ids,
  // offsets and sizes), their pattern unbroken, the job running on its
  // agent, the coordinator answering.
  void expect_victims_intact() {
    auto now = c.status();
    ASSERT_TRUE(now) << "the coordinator answers";
    auto leases_of = [](const nlohmann::json& s) {
      nlohmann::json out = nlohmann::json::array();
      for (const auto& l : s["leases"]) {
        if (l["agent"] == "victim") out.push_back({l["id"], l["offset"], l["size"]});
      }
      return out;
    };
    EXPECT_EQ(leases_of(*now), leases_of(before_)) << "the victim's leases are untouched";
    EXPECT_TRUE(leases_disjoint(*now));
    EXPECT_TRUE(pattern_->running()) << pattern_->log();
    EXPECT_EQ(pattern_->log().find("CORRUPTION"), std::string::npos) << pattern_->log();
    EXPECT_EQ(pid_of("victim"), [&] {
      for (const auto& a : (*now)["agents"]) {
        if (a["name"] == "victim") return a["pid"].get<int>();
      }
      return 0;
    }()) << "still the same process's session";
    const auto j = job();
    EXPECT_EQ(j["state"], "running") << j.dump();
    EXPECT_EQ(j["agent"], "worker");
    const auto& attempts = j["attempts"];
    EXPECT_EQ(attempts.is_array() ? attempts.size() : attempts.get<size_t>(), 1u)
        << "never restarted";
  }

  Cluster c;
  Process* coordinator_ = nullptr;
  Process* pattern_ = nullptr;
  nlohmann::json before_;
};

TEST_F(Attack, GuessedSessionTokensAreRefused) {
  Attacker a(c.endpoint(), "victim");  // claiming the victim's name, as the attacker did
  Attacker own(c.endpoint(), "mallory");
  const SessionToken mine = Attacker::token_of(own.register_as("mallory", getpid(), false));
  ASSERT_FALSE(mine.empty());
  // Before: the victim's token was the attacker's minus one. Now it is 128
  // random bits; try the neighbours and a random one.
  const std::vector<SessionToken> guesses{{mine.lo - 1, mine.hi}, {mine.lo + 1, mine.hi},
                                          {mine.lo - 1, 0}, {mine.lo, mine.hi - 1},
                                          SessionToken::random()};
  for (const auto& guess : guesses) {
    for (uint64_t lease : victim_leases()) {
      auto r = a.send(release(lease), guess);
      EXPECT_EQ(code_of(r), ErrorCode::UnknownSender) << message_of(r);
      EXPECT_EQ(code_of(a.send(resize(lease, 1u << 20), guess)), ErrorCode::UnknownSender);
    }
    EXPECT_EQ(code_of(a.send(heartbeat(), guess)), ErrorCode::UnknownSender);
    EXPECT_EQ(code_of(a.send(forged_success(1, 1), guess)), ErrorCode::UnknownSender);
    for (const auto& [what, build] : agent_messages()) {
      EXPECT_EQ(code_of(a.send(build, guess)), ErrorCode::UnknownSender) << what;
    }
  }
  // With its own valid token, the attacker owns none of it.
  for (uint64_t lease : victim_leases()) {
    auto r = own.send(release(lease), mine);
    EXPECT_EQ(code_of(r), ErrorCode::NotOwner) << message_of(r);
  }
  expect_victims_intact();
}

TEST_F(Attack, AForgedJobUpdateFromAnotherAgentIsRefused) {
  Attacker a(c.endpoint(), "mallory");
  const SessionToken mine = Attacker::token_of(a.register_as("mallory", getpid(), false));
  auto r = a.send(forged_success(1, 1), mine);
  EXPECT_EQ(code_of(r), ErrorCode::NotOwner);
  EXPECT_NE(message_of(r).find("is not running on agent 'mallory'"), std::string::npos)
      << message_of(r);
  expect_victims_intact();
  // No second job reaches the busy worker.
  auto [rc, out] = client({"submit", job_file("next", 1)});
  ASSERT_EQ(rc, 0) << out;
  // Had the forgery worked, the worker would be idle and get it at once.
  EXPECT_FALSE(c.wait_for(
      [](const auto& s) {
        for (const auto& a : s["agents"]) {
          if (a["name"] == "worker" && a["job_id"] != 1) return true;
        }
        return false;
      },
      2s))
      << "the worker keeps its job";
  EXPECT_EQ(job(2)["state"], "queued");
}

TEST_F(Attack, ARegisterCarryingAVictimsNameAndPidEvictsNobody) {
  Attacker a(c.endpoint(), "victim");
  const int pid = pid_of("victim");
  ASSERT_GT(pid, 0);
  // Before: 20 forged registers in 10 s cost the victim its session 6 times.
  for (int i = 0; i < 20; ++i) {
    auto r = a.register_as("victim", pid, i % 2 == 0);
    ASSERT_EQ(code_of(r), ErrorCode::NameTaken) << message_of(r);
    auto w = a.register_as("worker", pid_of("worker"), true);
    ASSERT_EQ(code_of(w), ErrorCode::NameTaken) << message_of(w);
    std::this_thread::sleep_for(50ms);
  }
  expect_victims_intact();
  EXPECT_EQ(coordinator_->log().find("'victim' registered again"), std::string::npos);
}

TEST_F(Attack, ForgedHeartbeatsDoNotKeepAKilledAgentsLeases) {
  auto& doomed = c.start_agent("doomed", {"--exercise", "--leases", "2", "--lease-size", "1MiB",
                                          "--rounds", "0", "--interval", "20ms"});
  ASSERT_TRUE(c.wait_for([](const auto& s) { return leased_by(s, "doomed") == 2u << 20; }, 10s));
  doomed.signal(SIGKILL);
  ASSERT_TRUE(doomed.wait(5s));
  // Keep "its" heartbeats coming with guessed tokens, for longer than the
  // coordinator waits for a silent agent (2 intervals of 1 s).
  Attacker a(c.endpoint(), "doomed");
  const auto until = std::chrono::steady_clock::now() + 4s;
  while (std::chrono::steady_clock::now() < until) {
    EXPECT_EQ(code_of(a.send(heartbeat(), SessionToken::random())), ErrorCode::UnknownSender);
    std::this_thread::sleep_for(50ms);
  }
  EXPECT_TRUE(c.wait_for(
      [](const auto& s) { return !has_agent(s, "doomed") && leased_by(s, "doomed") == 0; }, 10s))
      << "the dead agent's leases were reclaimed despite the heartbeats";
  expect_victims_intact();
}

TEST_F(Attack, HostileJobsAreRefusedAndTheLoopKeepsAnswering) {
  Attacker a(c.endpoint(), "mallory-client");
  // A FIFO as the dataset: before, the loop froze while nobody opened it.
  const std::string fifo = c.dir() + "/fifo-images";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  auto s = spec("fifo-job");
  s.dataset->train_images = fifo;
  const auto t0 = std::chrono::steady_clock::now();
  auto r = a.send(submit(s));
  EXPECT_EQ(code_of(r), ErrorCode::InvalidArgument);
  EXPECT_NE(message_of(r).find(fifo), std::string::npos) << message_of(r);
  EXPECT_NE(message_of(r).find("not a regular file"), std::string::npos) << message_of(r);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, kTimeout);

  // Names that would leave the checkpoint folder, forge a log line or
  // break JSON.
  const std::vector<std::string> names{"../escape", "..", "a/b",
                                       "forged\n2026-11-25 info: all is well", "bad\xff\xfe",
                                       std::string(129, 'n'), ""};
  for (const std::string& name : names) {
    auto rn = a.send(submit(spec(name)));
    EXPECT_EQ(code_of(rn), ErrorCode::InvalidArgument) << name;
    EXPECT_EQ(message_of(rn).find('\n'), std::string::npos) << "escaped: " << message_of(rn);
  }
  EXPECT_FALSE(fs::exists(c.state_dir() + "/escape")) << "nothing written outside";
  EXPECT_EQ(coordinator_->log().find("\n2026-11-25 info: all is well"), std::string::npos);

  // Absurd sizes: named limits.
  auto big = spec("forever");
  big.epochs = 200000;
  auto rb = a.send(submit(big));
  EXPECT_EQ(code_of(rb), ErrorCode::InvalidArgument);
  EXPECT_NE(message_of(rb).find("max_epochs 100000"), std::string::npos) << message_of(rb);

  // Jobs queued per user: the limit is 3 here, and the worker is busy.
  for (int i = 0; i < 3; ++i) {
    auto q = a.send(submit(spec("queued-" + std::to_string(i))));
    ASSERT_EQ(q->body_type(), proto::Body::JobAccepted) << message_of(q);
  }
  auto over = a.send(submit(spec("one-too-many")));
  EXPECT_EQ(code_of(over), ErrorCode::NoSpace);
  EXPECT_NE(message_of(over).find("queued_per_user 3"), std::string::npos) << message_of(over);
  auto [rc, out] = client({"jobs", "-o", "json"});
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(nlohmann::json::parse(out).size(), 4u) << "the victim's job and the 3 queued";
  expect_victims_intact();
}

TEST_F(Attack, AFakeAgentThatIgnoresItsAssignmentLosesTheJob) {
  // Before: a queued job went to a fake agent and stayed "running" for
  // good, and cancel could not end it.
  Attacker a(c.endpoint(), "fake");
  const SessionToken mine = Attacker::token_of(a.register_as("fake", getpid(), true));
  ASSERT_FALSE(mine.empty());
  auto [rc, out] = client({"submit", job_file("someone-elses", 1)});
  ASSERT_EQ(rc, 0) << out;
  bool assigned = false;
  a.connection().on_notice = [&](const Reply& n) {
    assigned = assigned || n->body_type() == proto::Body::AssignJob;
  };
  // The fake agent keeps its session alive but never acknowledges, past
  // assign_timeout (3 s here).
  const auto until = std::chrono::steady_clock::now() + 6s;
  while (std::chrono::steady_clock::now() < until) {
    EXPECT_EQ(code_of(a.send(heartbeat(), mine)), ErrorCode::None);
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_TRUE(assigned) << "the fake agent was offered the job";
  EXPECT_EQ(job(2)["state"], "queued") << "back in the queue after assign_timeout";
  EXPECT_NE(coordinator_->log().find("did not acknowledge"), std::string::npos)
      << coordinator_->log();
  // The exercise agent (takes no jobs) was never offered it either, and
  // cancel ends it.
  auto [rc2, out2] = client({"cancel", "2"});
  EXPECT_EQ(rc2, 0) << out2;
  EXPECT_EQ(job(2)["state"], "cancelled");
  expect_victims_intact();
}

TEST_F(Attack, AFakeAgentThatAcknowledgesAndIgnoresCancelLosesTheJob) {
  // Before: cancel could not end a job a fake agent held. This one even
  // acknowledges the job, then ignores every StopJob.
  Attacker a(c.endpoint(), "fake");
  const SessionToken mine = Attacker::token_of(a.register_as("fake", getpid(), true));
  ASSERT_FALSE(mine.empty());
  bool assigned = false;
  int stops = 0;
  a.connection().on_notice = [&](const Reply& n) {
    assigned = assigned || n->body_type() == proto::Body::AssignJob;
    stops += n->body_type() == proto::Body::StopJob;
  };
  auto [rc, out] = client({"submit", job_file("someone-elses", 1)});
  ASSERT_EQ(rc, 0) << out;
  for (int i = 0; i < 25 && !assigned; ++i) {
    a.send(heartbeat(), mine);
    std::this_thread::sleep_for(100ms);
  }
  ASSERT_TRUE(assigned) << "the fake agent took the job";
  EXPECT_EQ(code_of(a.send(heartbeat_running(2, 1), mine)), ErrorCode::None);
  auto [rc2, out2] = client({"cancel", "2"});
  EXPECT_EQ(rc2, 0) << out2;
  const auto until = std::chrono::steady_clock::now() + 5s;  // past stop_timeout (3 s)
  while (std::chrono::steady_clock::now() < until) {
    a.send(heartbeat_running(2, 1), mine);  // "still running", whatever it is told
    std::this_thread::sleep_for(200ms);
  }
  EXPECT_GT(stops, 0) << "it was told to stop";
  const auto j = job(2);
  EXPECT_EQ(j["state"], "cancelled") << j.dump();
  EXPECT_NE(j["reason"].get<std::string>().find("did not stop it within 3000 ms (stop_timeout)"),
            std::string::npos)
      << j.dump();
  // It gets nothing more in its session.
  auto [rc3, out3] = client({"submit", job_file("another", 1)});
  ASSERT_EQ(rc3, 0) << out3;
  assigned = false;
  for (int i = 0; i < 10; ++i) {
    a.send(heartbeat(), mine);
    std::this_thread::sleep_for(100ms);
  }
  EXPECT_FALSE(assigned) << "a second job for the agent that ignored a cancel";
  EXPECT_EQ(job(3)["state"], "queued");
  expect_victims_intact();
}

TEST_F(Attack, FloodsAndOversizedMessagesCostOnlyTheSender) {
  // A message over the 4 MiB limit: the sender is told before sending.
  Attacker a(c.endpoint(), "mallory");
  const std::string huge(kMaxMessageBytes, 'x');
  try {
    a.send([&](flatbuffers::FlatBufferBuilder& fbb) {
      return std::pair{proto::Body::GetJob, proto::CreateGetJob(fbb, 1).Union()};
    });
    a.send(submit(spec(huge)));
    ADD_FAILURE() << "an oversized request was sent";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("exceeds the protocol's limit"), std::string::npos)
        << e.what();
  }
  // The same bytes from a raw socket: the coordinator drops that connection.
  zmq::context_t ctx(1);
  zmq::socket_t raw(ctx, zmq::socket_type::dealer);
  raw.set(zmq::sockopt::linger, 0);
  raw.connect(c.endpoint());
  for (int i = 0; i < 4; ++i) raw.send(zmq::buffer(huge.data(), huge.size()), zmq::send_flags::none);
  // Garbage past malformed_limit (default 100): the connection is ignored.
  zmq::socket_t noisy(ctx, zmq::socket_type::dealer);
  noisy.set(zmq::sockopt::linger, 0);
  noisy.connect(c.endpoint());
  for (int i = 0; i < 2000; ++i) noisy.send(zmq::str_buffer("garbage"), zmq::send_flags::dontwait);
  std::this_thread::sleep_for(500ms);
  expect_victims_intact();
  const std::string log = coordinator_->log();
  EXPECT_LT(std::count(log.begin(), log.end(), '\n'), 60)
      << "logged once per interval, not once per message";
}

}  // namespace
}  // namespace leasehold::testing
