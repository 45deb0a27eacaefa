// The coordinator: one poll loop over a ROUTER socket, shaped like the
// ZeroMQ guide's Majordomo broker. It receives a request, checks it, answers
// it, then purges agents that stopped heart-beating and expires lease
// requests that waited too long. Malformed input is answered with an Error
// and changes nothing; nothing a peer sends can stop the loop.
//
// Thread safety: run() is called from one thread; request_stop() may be
// called from any thread or a signal handler.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>

#include <zmq.hpp>

#include "coordinator/job_table.h"
#include "coordinator/lease_table.h"
#include "coordinator/options.h"
#include "shared/device.h"
#include "shared/protocol.h"

namespace leasehold {

// A registered agent.
struct AgentRecord {
  std::string name;
  int pid = 0;
  int device = -1;
  uint64_t session = 0;                // token the agent must present
  std::set<std::string> routing_ids;   // its sockets (control, heartbeat)
  Clock::time_point registered;
  Clock::time_point last_seen;         // any valid message counts as a heartbeat;
                                       // in the future until the first one
  uint64_t job_id = 0;                 // the job it runs; 0 when idle (standby)
};

class Coordinator {
 public:
  // Creates the pool and binds the socket. Throws std::runtime_error naming
  // the cause (pool too large, endpoint in use by a live coordinator, ...).
  explicit Coordinator(const CoordinatorOptions& opts);
  ~Coordinator();

  // Serves until `stop` becomes true, then tells the agents and returns.
  // `tick`, if set, runs once per loop turn (at least every heartbeat/4): the
  // place for systemd's watchdog, so a hung loop stops the pings.
  void run(const std::atomic<bool>& stop, const std::function<void()>& tick = {});

  const PoolDescriptor& pool() const { return pool_->descriptor(); }
  // A one-line summary for logs and systemd's STATUS=.
  std::string summary() const;

 private:
  void handle(const std::string& routing_id, zmq::message_t& payload);
  void dispatch(const std::string& routing_id, const proto::Envelope& env);
  void on_register(const std::string& rid, const proto::Envelope& env);
  void on_lease_request(const std::string& rid, AgentRecord& agent, const proto::Envelope& env);
  void on_status(const std::string& rid, const proto::Envelope& env);
  void reply(const std::string& routing_id, zmq::message_t&& msg);
  void reply_error(const std::string& rid, uint64_t request_id, ErrorCode code,
                   const std::string& message);
  void reply_lease(const std::string& rid, uint64_t request_id, const LeaseRecord& rec);
  void reply_ack(const std::string& rid, uint64_t request_id, proto::Body type);
  // Answers waiting requests that became grantable.
  void serve_waiting();
  void purge_dead_agents(Clock::time_point now);
  void drop_agent(const std::string& name, const char* why);

  // Jobs (coordinator/jobs.cpp).
  void on_submit(const std::string& rid, const proto::Envelope& env);
  void on_list_jobs(const std::string& rid, const proto::Envelope& env);
  void on_get_job(const std::string& rid, const proto::Envelope& env);
  void on_cancel(const std::string& rid, const proto::Envelope& env);
  void on_job_update(const std::string& rid, AgentRecord& agent, const proto::Envelope& env);
  // Starts queued jobs on idle agents of the right device.
  void schedule();
  // Publishes the job's state on the PUB socket (topic "job.<id>.").
  void publish(const JobRecord& job);
  void push_to_agent(const AgentRecord& agent, flatbuffers::FlatBufferBuilder& fbb);
  void fail_jobs_of(const std::string& agent, const std::string& reason);

  CoordinatorOptions opts_;
  std::unique_ptr<DevicePool> pool_;
  std::unique_ptr<LeaseTable> leases_;
  std::map<std::string, AgentRecord> agents_;
  zmq::context_t ctx_;
  zmq::socket_t router_;
  zmq::socket_t pub_;     // job events
  JobTable jobs_;
  Clock::time_point started_;
  uint64_t next_session_;
};

}  // namespace leasehold
