// The coordinator's HTTP endpoint (read-only): the dashboard page (files
// embedded in the binary), /api/status, /api/jobs, /api/jobs/{id} (the same
// JSON as `leasehold … -o json`), /api/history (occupancy over the last ten
// minutes), /api/events (server-sent events: what the PUB socket carries)
// and /metrics (Prometheus text format).
//
// Served by one thread running an Asio io_context, with Boost.Beast's HTTP
// parser reading request heads, from what the poll loop publishes: nothing
// over HTTP reaches into the core or changes state, and no client, however
// slow or hostile, holds a thread. Why not cpp-httplib (0.11, what served it
// before): its limits are compile-time, its timeouts are per read (a byte
// every few seconds keeps a request alive for ever: eight such connections
// held all its threads), each open event stream held a thread, and it read
// chunked bodies and header lines into memory without bound (one 512 MiB
// chunked POST took the coordinator from 15 MiB to 1 GiB of RSS, 2M header
// lines left 229 MiB behind). Beast's parser has an explicit header limit
// and is asked for the head only, so the body is never read; deadlines are
// whole-request timers of our own; event streams are written asynchronously
// and cost a socket, not a thread. Under the same attacks the coordinator
// stays at 11 MiB and /api/status answers within milliseconds.
//
// Limits (each constant below says why its value):
// - no request body is read: a request announcing one (Content-Length > 0,
//   any Transfer-Encoding) is answered 413 (405 for a short body on a method
//   this endpoint does not serve, as before) and the connection closed;
// - the request line and headers: at most kMaxHeaderBytes and
//   kMaxHeaderFields lines (431 otherwise), arriving whole within
//   kRequestDeadline of the connection (or of the previous answer on a
//   kept-alive one): 408 and closed otherwise;
// - a response must be taken by the client within kWriteDeadline;
// - kMaxConnections connections in all (more wait in the kernel's listen
//   backlog), kMaxConnectionsPerAddress from one client address (more are
//   answered 503 and closed, or closed unanswered past kMaxRefusing), and
//   kMaxStreams open event streams (more: 503).
// A connection closed after an error is first half-closed and drained
// (discarded, never stored) for at most kLinger or kLingerBytes, so that a
// client still sending reads the answer rather than a reset.
//
// Host rule (DNS rebinding): every request carries exactly one Host header,
// a name or an address (IPv6 in brackets) with an optional port, else 400.
// Bound to a loopback address, the endpoint serves only requests naming a
// loopback host exactly ("localhost", an IPv4 address in 127.0.0.0/8, or
// [::1]; any port, since a forwarded port is still this endpoint), else
// 403: a web page whose name resolves to 127.0.0.1 names its own host.
// Bound to another address, any well-formed Host is served.
//
// Thread safety: the publish* calls come from the loop; requests are served
// on the endpoint's thread; every member is safe to call concurrently.
#pragma once

#include <chrono>
#include <cstddef>
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

namespace leasehold {

namespace http_detail {
struct Request;  // what a route needs of a request (http_endpoint.cpp)
struct Reply;    // a status, a content type and a body
}  // namespace http_detail

// "HOST:PORT" or "[V6ADDR]:PORT" as host and port; throws
// std::invalid_argument naming the value when it is neither.
std::pair<std::string, int> parse_http_listen(const std::string& listen);

class HttpEndpoint {
 public:
  // Connections at once. Each is a descriptor; the coordinator also needs
  // its own for ZeroMQ, agents and the job store under the usual soft limit
  // of 1024. Past this, new connections wait in the listen backlog.
  static constexpr int kMaxConnections = 128;
  // Connections from one client address at once: a browser opens up to six
  // per host, plus an event stream per tab, plus Prometheus; one address
  // cannot take more than a quarter of kMaxConnections. (On loopback every
  // local user is 127.0.0.1: this bounds what they hold together.)
  static constexpr int kMaxConnectionsPerAddress = 32;
  // Connections being answered 503 at once (over the per-address bound);
  // past this, such connections are closed unanswered, so that one address
  // cannot fill kMaxConnections with refusals.
  static constexpr int kMaxRefusing = 8;
  // Open /api/events streams at once (a dashboard tab holds one); more are
  // answered 503. They hold no thread, and they count as connections.
  static constexpr int kMaxStreams = 4;
  // Request line and headers, in bytes: a browser's are well under 4 KiB,
  // and nginx's default buffers for them are 8 KiB.
  static constexpr size_t kMaxHeaderBytes = 16 * 1024;
  // Header lines: browsers send about 15; Apache's default bound is 100.
  static constexpr int kMaxHeaderFields = 100;
  // A request arrives whole within this (not per byte: a byte every second
  // keeps no connection). A local client sends one in milliseconds.
  static constexpr std::chrono::seconds kRequestDeadline{10};
  // A response (the largest is a page of jobs) is taken within this.
  static constexpr std::chrono::seconds kWriteDeadline{10};
  // Draining a connection closed after an error: a client that is still
  // sending (a body, more header lines) reads the answer instead of a reset,
  // and costs at most this long and this many discarded bytes.
  static constexpr std::chrono::seconds kLinger{2};
  static constexpr size_t kLingerBytes = 4 << 20;
  // A request announcing a body is refused without reading it: 413, except
  // that a Content-Length of at most this on a method other than GET or
  // HEAD gets 405 (the method is what is wrong), the statuses clients of
  // the previous server saw.
  static constexpr size_t kMaxBody = 4096;
  // An idle stream gets a comment this often.
  static constexpr std::chrono::seconds kKeepAlive{15};
  // Occupancy samples kept for /api/history: one a second for ten minutes
  // (each with every device's occupancy and used bytes).
  static constexpr size_t kHistory = 600;

  // Binds `listen` ("HOST:PORT", "[::1]:PORT"; port 0 picks a free one) and
  // starts serving. Throws std::runtime_error naming the address when it
  // cannot (in use, no such address, bad form).
  explicit HttpEndpoint(const std::string& listen);
  // Closes every connection and stream, stops serving, joins the thread;
  // no descriptor is left open.
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  // The loop's latest status (as /api/status renders it) and metrics.
  void publish_status(std::string status_json, MetricsSnapshot metrics);
  // Jobs that changed since the last call, and jobs that are gone.
  void publish_jobs(std::vector<JobViews> changed, const std::vector<uint64_t>& removed);
  // One event for /api/events (a JSON text); never waits for a reader.
  void publish_event(std::string json);
  // Whether any /api/events stream is open (events need rendering only then).
  bool streaming() const { return events_.has_readers(); }

  int port() const { return port_; }

 private:
  class Server;      // the io_context, the acceptor, the limits' counts
  class Connection;  // one client connection
  using Request = http_detail::Request;
  using Reply = http_detail::Reply;
  using JobMap = std::map<uint64_t, JobViews>;
  struct Sample {
    uint64_t unix_ms;
    std::chrono::steady_clock::time_point steady;  // spacing, immune to clock steps
    // Per device, in the order of the status' devices.
    std::vector<double> occupancy;
    std::vector<uint64_t> used_bytes;
  };

  // The answer to a GET or HEAD that passed the checks (not /api/events).
  Reply serve(const Request& req) const;
  Reply serve_jobs(const Request& req) const;
  Reply serve_job(const std::string& id) const;
  Reply serve_history() const;

  EventStream events_;
  mutable std::mutex mu_;  // guards the published values below
  std::shared_ptr<const std::string> status_json_;
  std::shared_ptr<const MetricsSnapshot> metrics_;
  std::shared_ptr<const JobMap> jobs_;
  std::deque<Sample> history_;
  std::unique_ptr<Server> server_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace leasehold
