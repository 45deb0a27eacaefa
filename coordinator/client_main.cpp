// leasehold: the command-line client. Talks only to the coordinator.
//   leasehold status [--output table|json]
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <iostream>

#include "coordinator/status_format.h"
#include "shared/connection.h"
#include "shared/endpoint.h"
#include "shared/units.h"

namespace {

int run_status(const std::string& endpoint, std::chrono::milliseconds timeout,
               const std::string& output) {
  if (auto path = leasehold::ipc_path(endpoint); path && access(path->c_str(), F_OK) != 0) {
    throw std::runtime_error("no coordinator at " + endpoint + ": socket " + *path +
                             " does not exist (is leasehold-coordinator running? set "
                             "--endpoint or LEASEHOLD_ENDPOINT)");
  }
  zmq::context_t ctx(1);
  leasehold::Connection conn(ctx, endpoint, "leasehold-cli-" + std::to_string(getpid()));
  auto reply = conn.request(
      [](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{leasehold::proto::Body::StatusRequest,
                         leasehold::proto::CreateStatusRequest(fbb).Union()};
      },
      timeout);
  reply.throw_if_error();
  const auto* status = reply->body_as_StatusReply();
  if (!status) throw std::runtime_error("coordinator answered a status request with something else");
  if (output == "json") {
    std::cout << leasehold::status_to_json(*status).dump(2) << "\n";
  } else {
    std::cout << leasehold::status_to_table(*status);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"leasehold: inspect and drive a leasehold coordinator"};
  app.require_subcommand(1);
  std::string endpoint = leasehold::default_endpoint();
  std::string timeout_text = "3s";
  app.add_option("--endpoint", endpoint, "coordinator endpoint (env LEASEHOLD_ENDPOINT)")
      ->capture_default_str();
  app.add_option("--timeout", timeout_text, "how long to wait for the coordinator")
      ->capture_default_str();
  std::string output = "table";
  auto* status = app.add_subcommand("status", "show the pool, the agents and the leases");
  status->add_option("-o,--output", output, "table or json")
      ->check(CLI::IsMember({"table", "json"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);

  try {
    auto timeout = leasehold::parse_duration(timeout_text);
    if (*status) return run_status(endpoint, timeout, output);
  } catch (const std::exception& e) {
    std::cerr << "leasehold: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
