// The coordinator's HTTP endpoint (read-only): /api/status, the same JSON as
// `leasehold status -o json`, and /metrics in the Prometheus text format.
// cpp-httplib serves it on threads of its own, from what the poll loop
// publishes: a slow or hostile client holds an HTTP thread, never the loop.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "schemas/leasehold_generated.h"

namespace httplib {
class Server;
}
namespace prometheus {
class Registry;
}

namespace leasehold {

class CoordinatorMetrics;

class HttpEndpoint {
 public:
  // Binds `listen` ("HOST:PORT"); throws std::runtime_error naming the
  // address when it cannot (in use, no such address, bad form).
  // `gpu`/`uuid`: the labels of every series, as NVIDIA's DCGM exporter
  // writes them, so queries can join the two.
  HttpEndpoint(const std::string& listen, std::string gpu, std::string uuid);
  ~HttpEndpoint();  // stops serving and joins the server thread
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  // Called by the loop: the status to serve from now on.
  void publish(const proto::StatusReplyT& status);
  // The port bound (useful with port 0).
  int port() const { return port_; }

 private:
  std::shared_ptr<const std::string> status_json() const;

  std::unique_ptr<httplib::Server> server_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<CoordinatorMetrics> metrics_;
  mutable std::mutex mu_;
  std::shared_ptr<const std::string> status_json_;
  std::thread thread_;
  int port_ = 0;
};

}  // namespace leasehold
