// The rendezvous of a data-parallel engine job's replicas, as torch's
// TCPStore is for torchrun: rank 0 serves a small key-value store on the
// assignment's MASTER_ADDR:MASTER_PORT (ZeroMQ), and every replica, rank 0
// too, asks it. Gloo's full mesh, the NCCL unique id and each epoch's
// weight digests go through it. Every request carries the attempt's secret
// token (AssignJob.job_token_*), which only the gang's agents were given:
// another local user who finds the port can neither read nor plant keys.
//
// Waits give up at the rendezvous timeout with ReplicaLost (a replica never
// came, or died), and as soon as `stopping` says so with JobCancelled.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <gloo/rendezvous/store.h>
#include <memory>
#include <string>
#include <thread>
#include <vector>
#include <zmq.hpp>

#include "agent/replica.h"

namespace leasehold {

class ReplicaStore : public gloo::rendezvous::Store {
 public:
  // Rank 0 binds the port first (throws ReplicaLost when it cannot).
  // `stopping` must be safe to call from any thread.
  ReplicaStore(const Replica& replica, std::string token, std::function<bool()> stopping,
               std::chrono::milliseconds timeout = std::chrono::minutes(5));
  ~ReplicaStore() override;
  ReplicaStore(const ReplicaStore&) = delete;
  ReplicaStore& operator=(const ReplicaStore&) = delete;

  void set(const std::string& key, const std::vector<char>& data) override;
  // Waits until `key` is set.
  std::vector<char> get(const std::string& key) override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override;

  // Every replica's `value` under `name` (by rank), once all have set
  // theirs (waiting up to `timeout`, default the rendezvous timeout).
  std::vector<std::string> all_gather(const std::string& name, const std::string& value,
                                      std::chrono::milliseconds timeout = {});
  // The end of a successful run: rank 0 keeps serving until every replica
  // has said it is done with the store (or the timeout).
  void finish();
  const Replica& replica() const { return replica_; }

 private:
  // One request and its answer: {"ok", value} or {"none", ""}.
  std::pair<std::string, std::string> ask(const std::string& op, const std::string& key,
                                          const std::string& value = "");
  std::vector<char> get(const std::string& key, std::chrono::milliseconds timeout);
  void serve();

  const Replica replica_;
  const std::string token_;
  const std::function<bool()> stopping_;
  const std::chrono::milliseconds timeout_;
  zmq::context_t ctx_;
  zmq::socket_t client_;
  // Rank 0 only: the server's socket and thread.
  zmq::socket_t server_;
  std::thread server_thread_;
  std::atomic<bool> closing_{false};
};

}  // namespace leasehold
