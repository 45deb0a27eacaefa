// Test and benchmark support: submits jobs to a coordinator over its
// protocol and follows their ends on its PUB socket (the client's own
// start-up and polling out of the measurement).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include <zmq.hpp>

#include "shared/connection.h"

namespace leasehold::testing {

// A job's end as its final event showed it.
struct JobEnd {
  uint64_t id = 0;
  std::string state, reason;
  uint64_t assigned_at_us = 0, first_step_at_us = 0;
  uint64_t event_at_us = 0;  // when the event arrived (Unix µs)
  double samples_per_second = 0, test_accuracy = 0;
};

class JobClient {
 public:
  // Subscribes to the coordinator's job events at once.
  explicit JobClient(const std::string& endpoint);
  // Submits `spec`; returns the job id. Throws Error with the refusal.
  uint64_t submit(const proto::JobSpecT& spec);
  // Waits for the final events of `ids` (any order), up to `timeout`.
  // Throws std::runtime_error when one does not end in time.
  std::map<uint64_t, JobEnd> wait_ends(const std::vector<uint64_t>& ids,
                                       std::chrono::seconds timeout);
  // Drops every ready dataset region (the next job on the data fills it).
  void drop_dataset_regions();

 private:
  zmq::context_t ctx_{1};
  Connection conn_;
  zmq::socket_t events_;
};

// A job file as an object, for editing before submission.
std::unique_ptr<proto::JobSpecT> read_job_file(const std::string& path);

}  // namespace leasehold::testing
