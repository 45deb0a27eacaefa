#include "coordinator/http_endpoint.h"

#include <httplib.h>
#include <sys/socket.h>

#include <condition_variable>
#include <deque>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "coordinator/dashboard_files.h"

namespace leasehold {
namespace {

void error(httplib::Response& res, int status, const std::string& message) {
  res.status = status;
  res.set_content(nlohmann::json{{"error", message}}.dump(), "application/json");
}

// A query parameter as a number; `fallback` when absent. Throws
// std::invalid_argument naming it when it is not one.
uint64_t number_param(const httplib::Request& req, const char* name, uint64_t fallback) {
  if (!req.has_param(name)) return fallback;
  const std::string text = req.get_param_value(name);
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos ||
      text.size() > 19) {
    throw std::invalid_argument(std::string("query parameter '") + name +
                                "' must be a whole number, not '" + text + "'");
  }
  return std::stoull(text);
}

// cpp-httplib's ThreadPool queues accepted connections without bound, each
// holding a descriptor. This one makes the accepting thread wait while
// kQueued connections already wait: the rest stay in the kernel's listen
// backlog, and the coordinator's descriptors stay bounded.
class BoundedThreadPool : public httplib::TaskQueue {
 public:
  BoundedThreadPool(size_t threads, size_t queued) : max_queued_(queued) {
    for (size_t i = 0; i < threads; ++i) threads_.emplace_back([this] { work(); });
  }
  void enqueue(std::function<void()> fn) override {
    std::unique_lock lock(mu_);
    room_.wait(lock, [&] { return shutdown_ || jobs_.size() < max_queued_; });
    jobs_.push_back(std::move(fn));
    ready_.notify_one();
  }
  void shutdown() override {
    {
      std::lock_guard lock(mu_);
      shutdown_ = true;
    }
    ready_.notify_all();
    room_.notify_all();
    for (auto& t : threads_) t.join();
  }

 private:
  void work() {
    while (true) {
      std::function<void()> fn;
      {
        std::unique_lock lock(mu_);
        ready_.wait(lock, [&] { return shutdown_ || !jobs_.empty(); });
        if (jobs_.empty()) return;  // shutting down, nothing left
        fn = std::move(jobs_.front());
        jobs_.pop_front();
      }
      room_.notify_one();
      fn();  // serves the connection, then closes it
    }
  }

  const size_t max_queued_;
  std::mutex mu_;
  std::condition_variable ready_, room_;
  std::deque<std::function<void()>> jobs_;
  bool shutdown_ = false;
  std::vector<std::thread> threads_;
};

bool is_loopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1" || host.rfind("127.", 0) == 0;
}

// The host part of a Host header ("localhost:9464", "[::1]:9464").
std::string host_of(const std::string& header) {
  if (!header.empty() && header.front() == '[') return header.substr(1, header.find(']') - 1);
  return header.substr(0, header.find(':'));
}

uint64_t unix_ms_now() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace

std::pair<std::string, int> parse_http_listen(const std::string& listen) {
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size()) {
    throw std::invalid_argument("http_listen \"" + listen + "\" is not HOST:PORT");
  }
  int port = -1;
  try {
    size_t used = 0;
    port = std::stoi(listen.substr(colon + 1), &used);
    if (used != listen.size() - colon - 1) port = -1;
  } catch (const std::exception&) {
  }
  if (port < 0 || port > 65535) {
    throw std::invalid_argument("http_listen \"" + listen + "\": bad port");
  }
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // [::1]
  }
  return {host, port};
}

HttpEndpoint::HttpEndpoint(const std::string& listen)
    : status_json_(std::make_shared<const std::string>("{}")),
      metrics_(std::make_shared<const MetricsSnapshot>()),
      jobs_(std::make_shared<const JobMap>()),
      server_(std::make_unique<httplib::Server>()) {
  auto [host, port] = parse_http_listen(listen);
  // SO_REUSEADDR only (a restart binds at once), not cpp-httplib's default
  // SO_REUSEPORT, with which a second coordinator would share the port.
  server_->set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  server_->new_task_queue = [] { return new BoundedThreadPool(kThreads, kQueued); };
  // Requests here are GETs: a body is refused (413) before it is read.
  server_->set_payload_max_length(kMaxBody);
  // Bound to loopback, only requests that name a loopback host are served:
  // a web page elsewhere cannot read the API through DNS rebinding.
  if (is_loopback(host)) {
    server_->set_pre_routing_handler([](const httplib::Request& req, httplib::Response& res) {
      const std::string host = host_of(req.get_header_value("Host"));
      if (is_loopback(host)) return httplib::Server::HandlerResponse::Unhandled;
      error(res, 403, "Host '" + host + "' is not this loopback endpoint");
      return httplib::Server::HandlerResponse::Handled;
    });
  }
  // A client that stops sending or reading costs one HTTP thread for at
  // most these, never the loop.
  server_->set_read_timeout(5, 0);
  server_->set_write_timeout(5, 0);
  server_->set_keep_alive_timeout(5);
  route();
  if (port == 0) {
    port_ = server_->bind_to_any_port(host);
  } else {
    port_ = server_->bind_to_port(host, port) ? port : -1;
  }
  if (port_ < 0) {
    throw std::runtime_error("cannot serve HTTP on " + listen +
                             " (address in use or not on this machine; set http_listen, or "
                             "\"off\")");
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  // stop() before the server runs would be lost, and the destructor's join
  // would wait forever.
  while (!server_->is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

HttpEndpoint::~HttpEndpoint() {
  events_.close();  // open streams end at once
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void HttpEndpoint::route() {
  auto& s = *server_;
  auto file = [](const std::string& name, const httplib::Request& req, httplib::Response& res) {
    const DashboardFile* f = find_dashboard_file(name);
    if (!f) return error(res, 404, "no such page: " + req.path);
    res.set_header("Cache-Control", "no-cache");
    res.set_content(std::string(f->bytes), std::string(f->content_type));
  };
  s.Get("/", [file](const httplib::Request& req, httplib::Response& res) {
    file("index.html", req, res);
  });
  s.Get("/api/status", [this](const httplib::Request&, httplib::Response& res) {
    std::shared_ptr<const std::string> json;
    {
      std::lock_guard lock(mu_);
      json = status_json_;
    }
    res.set_content(*json, "application/json");
  });
  s.Get("/api/jobs", [this](const httplib::Request& q, httplib::Response& r) { serve_jobs(q, r); });
  s.Get(R"(/api/jobs/([^/]+))",
        [this](const httplib::Request& q, httplib::Response& r) { serve_job(q, r); });
  s.Get("/api/history", [this](const httplib::Request&, httplib::Response& r) { serve_history(r); });
  s.Get("/api/events", [this](const httplib::Request&, httplib::Response& r) { serve_events(r); });
  s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    std::shared_ptr<const MetricsSnapshot> m;
    {
      std::lock_guard lock(mu_);
      m = metrics_;
    }
    res.set_content(render_metrics(*m), "text/plain; version=0.0.4; charset=utf-8");
  });
  s.Get(R"(/([a-z.]+))", [file](const httplib::Request& req, httplib::Response& res) {
    file(req.matches[1].str(), req, res);
  });
  // Read-only: nothing over HTTP changes state.
  auto read_only = [](const httplib::Request& req, httplib::Response& res) {
    error(res, 405, req.method + " is not served: the HTTP endpoint is read-only");
  };
  s.Post(".*", read_only);
  s.Put(".*", read_only);
  s.Patch(".*", read_only);
  s.Delete(".*", read_only);
  s.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    error(res, res.status,
          res.status == 404 ? "no such page: " + req.path
                            : "request refused (HTTP " + std::to_string(res.status) + ")");
  });
}

void HttpEndpoint::serve_jobs(const httplib::Request& req, httplib::Response& res) const {
  uint64_t after = 0, limit = 0, newest = 0;
  try {
    after = number_param(req, "after", 0);
    limit = number_param(req, "limit", 0);
    newest = number_param(req, "newest", 0);
  } catch (const std::invalid_argument& e) {
    return error(res, 400, e.what());
  }
  std::shared_ptr<const JobMap> jobs;
  {
    std::lock_guard lock(mu_);
    jobs = jobs_;
  }
  // In id order: those after `after` (a page of `limit`), or the `newest`.
  auto it = jobs->upper_bound(after);
  if (newest) {
    it = jobs->end();
    for (uint64_t n = 0; n < newest && it != jobs->begin(); ++n) --it;
  }
  std::string out = "[";
  for (uint64_t n = 0; it != jobs->end() && (limit == 0 || n < limit); ++it, ++n) {
    if (n) out += ',';
    out += render_job_json(*it->second.summary);
  }
  out += ']';
  res.set_content(out, "application/json");
}

void HttpEndpoint::serve_job(const httplib::Request& req, httplib::Response& res) const {
  const std::string text = req.matches[1].str();
  uint64_t id = 0;
  if (text.empty() || text.size() > 19 || text.find_first_not_of("0123456789") != std::string::npos ||
      (id = std::stoull(text)) == 0) {
    return error(res, 400, "'" + text + "' is not a job id");
  }
  std::shared_ptr<const JobMap> jobs;
  {
    std::lock_guard lock(mu_);
    jobs = jobs_;
  }
  auto it = jobs->find(id);
  if (it == jobs->end()) return error(res, 404, "no job with id " + text);
  res.set_content(render_job_json(*it->second.full), "application/json");
}

void HttpEndpoint::serve_history(httplib::Response& res) const {
  std::deque<Sample> samples;
  {
    std::lock_guard lock(mu_);
    samples = history_;
  }
  nlohmann::json out = nlohmann::json::array();
  for (const auto& s : samples) out.push_back({s.unix_ms, s.occupancy, s.used_bytes});
  res.set_content(nlohmann::json{{"columns", {"unix_ms", "occupancy", "used_bytes"}},
                                 {"samples", std::move(out)}}
                      .dump(),
                  "application/json");
}

void HttpEndpoint::serve_events(httplib::Response& res) {
  if (!events_.attach(kMaxStreams)) {
    return error(res, 503,
                 "too many event streams open (at most " + std::to_string(kMaxStreams) + ")");
  }
  auto cursor = std::make_shared<uint64_t>(events_.end());
  auto last_write = std::make_shared<std::chrono::steady_clock::time_point>();
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [this, cursor, last_write](size_t offset, httplib::DataSink& sink) {
        const auto now = std::chrono::steady_clock::now();
        // A comment first, so the browser sees the stream open at once.
        if (offset == 0) {
          *last_write = now;
          return sink.write(": leasehold events\n\n", 20);
        }
        // Short waits: a reader that went away gives its place back
        // within a second.
        auto batch = events_.next(*cursor, std::chrono::seconds(1));
        if (batch.closed) {
          sink.done();
          return true;
        }
        std::string out;
        if (batch.missed) {
          out += "event: missed\ndata: {\"missed\":" + std::to_string(batch.missed) + "}\n\n";
        }
        for (const auto& e : batch.events) out += "data: " + *e + "\n\n";
        if (out.empty()) {
          if (!sink.is_writable()) return false;
          if (now - *last_write < kKeepAlive) return true;  // called again at once
          out = ": idle\n\n";  // keeps proxies from closing an idle stream
        }
        *last_write = now;
        return sink.write(out.data(), out.size());
      },
      [this](bool) { events_.detach(); });
}

void HttpEndpoint::publish_status(std::string status_json, MetricsSnapshot metrics) {
  auto json = std::make_shared<const std::string>(std::move(status_json));
  const Sample sample{unix_ms_now(), std::chrono::steady_clock::now(), metrics.occupancy,
                      metrics.used_bytes};
  auto m = std::make_shared<const MetricsSnapshot>(std::move(metrics));
  std::lock_guard lock(mu_);
  status_json_ = std::move(json);
  metrics_ = std::move(m);
  if (history_.empty() || sample.steady - history_.back().steady >= std::chrono::seconds(1)) {
    history_.push_back(sample);
    if (history_.size() > kHistory) history_.pop_front();
  }
}

void HttpEndpoint::publish_jobs(std::vector<JobViews> changed, const std::vector<uint64_t>& removed) {
  std::shared_ptr<const JobMap> current;
  {
    std::lock_guard lock(mu_);
    current = jobs_;
  }
  // Copy on write: requests being served keep the map they took.
  auto next = std::make_shared<JobMap>(*current);
  for (uint64_t id : removed) next->erase(id);
  for (auto& j : changed) {
    const uint64_t id = j.id;
    (*next)[id] = std::move(j);
  }
  std::lock_guard lock(mu_);
  jobs_ = std::move(next);
}

}  // namespace leasehold
