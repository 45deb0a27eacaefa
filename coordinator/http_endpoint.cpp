#include "coordinator/http_endpoint.h"

#include <cstdio>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "coordinator/dashboard_files.h"
#include "coordinator/http_server.h"

namespace leasehold {
namespace {

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
      server_(std::make_unique<Server>(*this, listen)),
      port_(server_->port()) {
  thread_ = std::thread([s = server_.get()] { s->run(); });
}

HttpEndpoint::~HttpEndpoint() {
  events_.close();  // no new stream
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void HttpEndpoint::publish_event(std::string json) {
  events_.push(std::move(json));
  server_->wake();
}

Reply HttpEndpoint::serve(const Request& req) const {
  const std::string& path = req.path;
  auto file = [&](const std::string& name) {
    const DashboardFile* f = find_dashboard_file(name);
    if (!f) return error_reply(404, "no such page: " + shown(path));
    return Reply{200, std::string(f->content_type), std::string(f->bytes), true};
  };
  if (path == "/") return file("index.html");
  if (path == "/api/status") {
    std::shared_ptr<const std::string> json;
    {
      std::lock_guard lock(mu_);
      json = status_json_;
    }
    return {200, "application/json", *json, false};
  }
  if (path == "/api/jobs") return serve_jobs(req);
  const std::string jobs_prefix = "/api/jobs/";
  if (path.size() > jobs_prefix.size() && path.compare(0, jobs_prefix.size(), jobs_prefix) == 0 &&
      path.find('/', jobs_prefix.size()) == std::string::npos) {
    return serve_job(path.substr(jobs_prefix.size()));
  }
  if (path == "/api/history") return serve_history();
  if (path == "/metrics") {
    std::shared_ptr<const MetricsSnapshot> m;
    {
      std::lock_guard lock(mu_);
      m = metrics_;
    }
    return {200, "text/plain; version=0.0.4; charset=utf-8", render_metrics(*m), false};
  }
  if (path.size() > 1 &&
      path.find_first_not_of("abcdefghijklmnopqrstuvwxyz.", 1) == std::string::npos) {
    return file(path.substr(1));
  }
  return error_reply(404, "no such page: " + shown(path));
}

Reply HttpEndpoint::serve_jobs(const Request& req) const {
  uint64_t after = 0, limit = 0, newest = 0;
  try {
    after = number_param(req, "after", 0);
    limit = number_param(req, "limit", 0);
    newest = number_param(req, "newest", 0);
  } catch (const std::invalid_argument& e) {
    return error_reply(400, e.what());
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
  return {200, "application/json", std::move(out), false};
}

Reply HttpEndpoint::serve_job(const std::string& text) const {
  uint64_t id = 0;
  if (text.empty() || text.size() > 19 ||
      text.find_first_not_of("0123456789") != std::string::npos || (id = std::stoull(text)) == 0) {
    return error_reply(400, "'" + shown(text) + "' is not a job id");
  }
  std::shared_ptr<const JobMap> jobs;
  {
    std::lock_guard lock(mu_);
    jobs = jobs_;
  }
  auto it = jobs->find(id);
  if (it == jobs->end()) return error_reply(404, "no job with id " + text);
  return {200, "application/json", render_job_json(*it->second.full), false};
}

Reply HttpEndpoint::serve_history() const {
  std::deque<Sample> samples;
  {
    std::lock_guard lock(mu_);
    samples = history_;
  }
  // A sample is [unix_ms, [occupancy per device], [used bytes per device]].
  nlohmann::json out = nlohmann::json::array();
  for (const auto& s : samples) out.push_back({s.unix_ms, s.occupancy, s.used_bytes});
  return {200, "application/json",
          nlohmann::json{{"columns", {"unix_ms", "occupancy", "used_bytes"}},
                         {"samples", std::move(out)}}
              .dump(),
          false};
}

void HttpEndpoint::publish_status(std::string status_json, MetricsSnapshot metrics) {
  auto json = std::make_shared<const std::string>(std::move(status_json));
  Sample sample{unix_ms_now(), std::chrono::steady_clock::now(), {}, {}};
  for (const auto& d : metrics.devices) {
    sample.occupancy.push_back(d.occupancy);
    sample.used_bytes.push_back(d.used_bytes);
  }
  auto m = std::make_shared<const MetricsSnapshot>(std::move(metrics));
  std::lock_guard lock(mu_);
  status_json_ = std::move(json);
  metrics_ = std::move(m);
  if (history_.empty() || sample.steady - history_.back().steady >= std::chrono::seconds(1)) {
    history_.push_back(std::move(sample));
    if (history_.size() > kHistory) history_.pop_front();
  }
}

void HttpEndpoint::publish_jobs(std::vector<JobViews> changed,
                                const std::vector<uint64_t>& removed) {
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
