// The coordinator's HTTP endpoint (read-only): the dashboard page (files
// embedded in the binary), /api/status, /api/jobs, /api/jobs/{id} (the same
// JSON as `leasehold … -o json`), /api/history (occupancy over the last ten
// minutes), /api/events (server-sent events: what the PUB socket carries)
// and /metrics (Prometheus text format).
//
// cpp-httplib serves it on a thread pool of its own, from what the poll
// loop publishes: a slow or hostile client holds an HTTP thread for at most
// the read/write timeout, never the loop, and nothing over HTTP reaches
// into the core or changes state.
//
// Thread safety: the publish* calls come from the loop; requests are served
// from other threads; every member is safe to call concurrently.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "coordinator/event_stream.h"
#include "coordinator/http_views.h"
#include "coordinator/metrics.h"

namespace httplib {
class Server;
struct Request;
struct Response;
}  // namespace httplib

namespace leasehold {

// "HOST:PORT" or "[V6ADDR]:PORT" as host and port; throws
// std::invalid_argument naming the value when it is neither.
std::pair<std::string, int> parse_http_listen(const std::string& listen);

class HttpEndpoint {
 public:
  // At most this many /api/events streams at once (each holds one of the
  // kThreads server threads while open); more are answered 503.
  static constexpr int kThreads = 8;
  // Accepted connections waiting for a thread; past this the acceptor waits.
  static constexpr size_t kQueued = 32;
  // Largest request body read (requests are GETs).
  static constexpr size_t kMaxBody = 4096;
  static constexpr int kMaxStreams = 4;
  // An idle stream gets a comment this often.
  static constexpr std::chrono::seconds kKeepAlive{15};
  // Occupancy samples kept for /api/history: one a second for ten minutes.
  static constexpr size_t kHistory = 600;

  // Binds `listen` ("HOST:PORT", "[::1]:PORT"; port 0 picks a free one).
  // Throws std::runtime_error naming the address when it cannot (in use,
  // no such address, bad form).
  explicit HttpEndpoint(const std::string& listen);
  ~HttpEndpoint();  // closes the streams, stops serving, joins the threads
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  // The loop's latest status (as /api/status renders it) and metrics.
  void publish_status(std::string status_json, MetricsSnapshot metrics);
  // Jobs that changed since the last call, and jobs that are gone.
  void publish_jobs(std::vector<JobViews> changed, const std::vector<uint64_t>& removed);
  // One event for /api/events (a JSON text).
  void publish_event(std::string json) { events_.push(std::move(json)); }
  // Whether any /api/events stream is open (events need rendering only then).
  bool streaming() const { return events_.has_readers(); }

  int port() const { return port_; }

 private:
  using JobMap = std::map<uint64_t, JobViews>;
  struct Sample {
    uint64_t unix_ms;
    std::chrono::steady_clock::time_point steady;  // spacing, immune to clock steps
    double occupancy;
    uint64_t used_bytes;
  };

  void route();
  void serve_jobs(const httplib::Request& req, httplib::Response& res) const;
  void serve_job(const httplib::Request& req, httplib::Response& res) const;
  void serve_history(httplib::Response& res) const;
  void serve_events(httplib::Response& res);

  EventStream events_;
  mutable std::mutex mu_;  // guards the published values below
  std::shared_ptr<const std::string> status_json_;
  std::shared_ptr<const MetricsSnapshot> metrics_;
  std::shared_ptr<const JobMap> jobs_;
  std::deque<Sample> history_;
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace leasehold
