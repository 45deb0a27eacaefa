#include "coordinator/http_endpoint.h"

#include <httplib.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <map>
#include <set>
#include <stdexcept>

#include "client/status_format.h"

namespace leasehold {

// The series the status carries, labelled gpu and UUID as DCGM's are.
// prometheus-cpp keeps them thread-safe: the loop sets them, an HTTP
// thread serializes them.
class CoordinatorMetrics {
 public:
  CoordinatorMetrics(prometheus::Registry& r, std::string gpu, std::string uuid)
      : labels_{{"gpu", std::move(gpu)}, {"UUID", std::move(uuid)}},
        size_(gauge(r, "leasehold_pool_size_bytes", "Size of the pool")),
        used_(gauge(r, "leasehold_pool_used_bytes", "Bytes of the pool leased")),
        free_(gauge(r, "leasehold_pool_free_bytes", "Bytes of the pool not leased")),
        largest_(gauge(r, "leasehold_pool_largest_free_bytes", "Largest free block")),
        occupancy_(gauge(r, "leasehold_pool_occupancy_ratio", "Leased bytes / pool size")),
        leases_(gauge(r, "leasehold_leases", "Leases held")),
        waiting_(gauge(r, "leasehold_lease_requests_waiting", "Lease requests waiting")),
        agents_(prometheus::BuildGauge()
                    .Name("leasehold_agents")
                    .Help("Agents by state")
                    .Register(r)) {}

  void update(const proto::StatusReplyT& s) {
    if (s.pool && s.pool->info) size_.Set(double(s.pool->info->size));
    if (s.pool) {
      used_.Set(double(s.pool->used_bytes));
      free_.Set(double(s.pool->free_bytes));
      largest_.Set(double(s.pool->largest_free_bytes));
    }
    if (s.occupancy) occupancy_.Set(s.occupancy->occupancy);
    leases_.Set(double(s.leases.size()));
    waiting_.Set(double(s.pending_requests));
    std::map<std::string, int> by_state;
    for (const auto& a : s.agents) ++by_state[a->state];
    // A state seen once stays a series (at 0), so it does not vanish.
    for (const auto& [state, n] : by_state) states_.insert(state);
    for (const auto& state : states_) {
      auto labels = labels_;
      labels["state"] = state;
      agents_.Add(labels).Set(by_state.count(state) ? by_state[state] : 0);
    }
  }

 private:
  prometheus::Gauge& gauge(prometheus::Registry& r, const std::string& name,
                           const std::string& help) {
    return prometheus::BuildGauge().Name(name).Help(help).Register(r).Add(labels_);
  }

  std::map<std::string, std::string> labels_;
  prometheus::Gauge &size_, &used_, &free_, &largest_, &occupancy_, &leases_, &waiting_;
  prometheus::Family<prometheus::Gauge>& agents_;
  std::set<std::string> states_;
};

namespace {

std::pair<std::string, int> split_listen(const std::string& listen) {
  const auto colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size()) {
    throw std::runtime_error("http_listen \"" + listen + "\" is not HOST:PORT");
  }
  int port = -1;
  try {
    size_t used = 0;
    port = std::stoi(listen.substr(colon + 1), &used);
    if (used != listen.size() - colon - 1) port = -1;
  } catch (const std::exception&) {
  }
  if (port < 0 || port > 65535) {
    throw std::runtime_error("http_listen \"" + listen + "\": bad port");
  }
  std::string host = listen.substr(0, colon);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);  // [::1]
  }
  return {host, port};
}

}  // namespace

HttpEndpoint::HttpEndpoint(const std::string& listen, std::string gpu, std::string uuid)
    : server_(std::make_unique<httplib::Server>()),
      registry_(std::make_shared<prometheus::Registry>()),
      metrics_(std::make_unique<CoordinatorMetrics>(*registry_, std::move(gpu), std::move(uuid))),
      status_json_(std::make_shared<const std::string>("{}")) {
  auto [host, port] = split_listen(listen);
  // SO_REUSEADDR only (a restart binds at once), not cpp-httplib's default
  // SO_REUSEPORT, with which a second coordinator would share the port.
  server_->set_socket_options([](int sock) {
    int yes = 1;
    ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
  });
  // A client that stops sending or reading costs one HTTP thread for at
  // most these, never the loop.
  server_->set_read_timeout(5, 0);
  server_->set_write_timeout(5, 0);
  server_->Get("/api/status", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(*status_json(), "application/json");
  });
  server_->Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(prometheus::TextSerializer().Serialize(registry_->Collect()),
                    "text/plain; version=0.0.4");
  });
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
}

HttpEndpoint::~HttpEndpoint() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

void HttpEndpoint::publish(const proto::StatusReplyT& status) {
  metrics_->update(status);
  flatbuffers::FlatBufferBuilder fbb;
  fbb.Finish(proto::StatusReply::Pack(fbb, &status));
  auto json = std::make_shared<const std::string>(
      status_to_json(*flatbuffers::GetRoot<proto::StatusReply>(fbb.GetBufferPointer())).dump());
  std::lock_guard lock(mu_);
  status_json_ = std::move(json);
}

std::shared_ptr<const std::string> HttpEndpoint::status_json() const {
  std::lock_guard lock(mu_);
  return status_json_;
}

}  // namespace leasehold
