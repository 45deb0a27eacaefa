// leasehold: the command-line client. Talks only to the coordinator.
//   leasehold status | submit FILE [--follow] | run [OPTIONS] -- CMD... | jobs | job ID
//             | cancel ID | logs ID [--follow] | regions [drop NAME] | keygen PATH
// Exit codes: client/exit_codes.h.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <iostream>

#include "client/exit_codes.h"
#include "client/jobs.h"
#include "client/json_text.h"
#include "client/programs.h"
#include "client/regions.h"
#include "client/requests.h"
#include "client/status_format.h"
#include "shared/connection.h"
#include "shared/endpoint.h"
#include "shared/units.h"

namespace {

int run_status(const leasehold::client::Context& c, const std::string& output) {
  zmq::context_t ctx(1);
  leasehold::Connection conn(ctx, c.endpoint, "leasehold-cli-" + std::to_string(getpid()), c.curve);
  auto reply = conn.request(
      [](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{leasehold::proto::Body::StatusRequest,
                         leasehold::proto::CreateStatusRequest(fbb).Union()};
      },
      c.timeout);
  reply.throw_if_error();
  const auto* status = reply->body_as_StatusReply();
  if (!status) throw std::runtime_error("coordinator answered a status request with something else");
  if (output == "json") {
    std::cout << leasehold::json_text(leasehold::status_to_json(*status)) << "\n";
  } else {
    std::cout << leasehold::status_to_table(*status);
  }
  return 0;
}

// Writes a CURVE key pair: PATH (secret) and PATH.pub.
int run_keygen(const std::string& path) {
  const auto keys = leasehold::generate_curve_key_pair();
  leasehold::write_curve_key_pair(path, keys);
  std::cout << "wrote " << path << " (key pair, mode 0600) and " << path
            << ".pub (public key " << keys.public_key << ")\n";
  return 0;
}

}  // namespace

using namespace leasehold::client;  // the exit codes

int main(int argc, char** argv) {
  CLI::App app{"leasehold: inspect and drive a leasehold coordinator"};
  app.require_subcommand(1);
  std::string endpoint = leasehold::default_endpoint();
  std::string timeout_text = "3s";
  app.add_option("--endpoint", endpoint, "coordinator endpoint (env LEASEHOLD_ENDPOINT)")
      ->capture_default_str();
  auto* timeout_opt =
      app.add_option("--timeout", timeout_text,
                     "how long to wait for the coordinator (submit: 15s, as the coordinator "
                     "first checks the job's dataset files)")
          ->capture_default_str();
  std::string events_endpoint;
  app.add_option("--events-endpoint", events_endpoint,
                 "coordinator's job events endpoint (default: next to an ipc endpoint)");
  std::string curve_key, curve_server_key;
  app.add_option("--curve-key", curve_key,
                 "this client's CURVE key pair file, for a tcp:// endpoint (env "
                 "LEASEHOLD_CURVE_KEY; made by `leasehold keygen`)");
  app.add_option("--curve-server-key", curve_server_key,
                 "the coordinator's CURVE public key file (env LEASEHOLD_CURVE_SERVER_KEY)");
  std::string output = "table";
  auto add_output = [&](CLI::App* cmd) {
    cmd->add_option("-o,--output", output, "table or json")
        ->check(CLI::IsMember({"table", "json"}))
        ->capture_default_str();
  };
  auto* status = app.add_subcommand("status", "show the pool, the agents and the leases");
  add_output(status);

  std::string file;
  bool follow = false;
  int priority = 0;
  uint64_t id = 0;
  // Job ids count from 1, in decimal: CLI11 alone would take "-1" as a huge
  // number and "010" as octal 8, so the digits are checked and leading
  // zeros dropped before it converts them.
  const CLI::Validator job_id(
      [](std::string& text) -> std::string {
        const bool digits = !text.empty() && std::all_of(text.begin(), text.end(), [](char c) {
          return c >= '0' && c <= '9';
        });
        const size_t first = text.find_first_not_of('0');
        if (digits && first != std::string::npos && text.size() - first <= 19) {
          text.erase(0, first);
          return "";
        }
        return "a job id is a whole number from 1 (leasehold jobs lists them), not '" + text + "'";
      },
      "ID");
  auto* submit = app.add_subcommand("submit", "submit a job file (JSON); prints the job id");
  submit->add_option("file", file, "job file")->required();
  submit->add_flag("-f,--follow", follow, "follow progress; exit with the job's outcome");
  auto* prio = submit->add_option("--priority", priority, "overrides the file's priority");
  int epochs = 0;
  auto* epochs_opt = submit->add_option("--epochs", epochs, "overrides the file's epochs")
                         ->check(CLI::PositiveNumber);
  add_output(submit);
  auto* jobs = app.add_subcommand("jobs", "list jobs");
  add_output(jobs);
  auto* job = app.add_subcommand("job", "show one job: spec, state history, metrics, result");
  job->add_option("id", id, "job id")->required()->transform(job_id);
  add_output(job);
  auto* cancel = app.add_subcommand("cancel", "cancel a queued or running job");
  cancel->add_option("id", id, "job id")->required()->transform(job_id);
  auto* logs = app.add_subcommand(
      "logs", "print a program job's output, or an engine job's progress and epoch results");
  logs->add_option("id", id, "job id")->required()->transform(job_id);
  logs->add_flag("-f,--follow", follow, "keep following until the job ends");
  add_output(logs);
  std::string checkpoint_output, checkpoint_format = "auto";
  auto* checkpoint = app.add_subcommand(
      "checkpoint", "fetch a job's latest checkpoint (yours, or any as an administrator)");
  checkpoint->add_option("id", id, "job id")->required()->transform(job_id);
  checkpoint->add_option("-o,--output", checkpoint_output, "the file to write")->required();
  checkpoint->add_option("--format", checkpoint_format,
                         "lhckpt (as the engine wrote it), safetensors (PyTorch, JAX, Hugging "
                         "Face), or auto: safetensors for a .safetensors file")
      ->check(CLI::IsMember({"auto", "lhckpt", "safetensors"}))
      ->capture_default_str();
  auto* regions = app.add_subcommand("regions", "list the shared cache regions");
  add_output(regions);
  std::string region_name;
  auto* drop = regions->add_subcommand("drop", "drop an unattached region and free its memory");
  drop->add_option("name", region_name, "region name")->required();
  leasehold::client::RunOptions run_options;
  auto* run = app.add_subcommand(
      "run", "run a program as a job, with the current folder: stream its output, exit with "
             "its status; Ctrl-C cancels it (`leasehold run --budget 6GiB -- python3 train.py`)");
  run->add_option("--budget", run_options.budget, "memory_budget, e.g. 6GiB (default 1GiB)");
  run->add_option("--min", run_options.min,
                  "memory_min: the part of the budget it is guaranteed; the rest the occupancy "
                  "policy may ask back (default: the whole budget)");
  run->add_option("--device", run_options.device,
                 "auto, cuda or cpu, or cuda:N / cpu:N pinning device N (default auto)");
  run->add_option("--name", run_options.name, "the job's name (default: from the command)");
  run->add_option("command", run_options.command, "the program and its arguments, after --")
      ->required();
  std::string key_path;
  auto* keygen = app.add_subcommand(
      "keygen", "write a CURVE key pair for tcp:// endpoints: PATH (secret, 0600) and PATH.pub");
  keygen->add_option("path", key_path, "where to write the key pair")->required();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help prints and succeeds; any other mistake on the command line is
    // invalid input, whatever CLI11's own code for it.
    return app.exit(e) == 0 ? kExitOk : kExitInvalid;
  }

  if (*keygen) {
    try {
      return run_keygen(key_path);
    } catch (const std::exception& e) {
      std::cerr << "leasehold keygen: " << e.what() << "\n";
      return kExitInvalid;
    }
  }

  // A job file is read and checked before the coordinator is looked for:
  // its mistakes are the user's to fix first.
  std::unique_ptr<leasehold::proto::JobSpecT> spec;
  if (*submit) {
    leasehold::client::SubmitOverrides o;
    if (prio->count()) o.priority = priority;
    if (epochs_opt->count()) o.epochs = epochs;
    try {
      spec = leasehold::client::load_job_file(file, o);
    } catch (const std::exception& e) {
      std::cerr << "leasehold: " << e.what() << "\n";
      return kExitInvalid;
    }
  }

  leasehold::client::Context ctx;
  try {
    ctx.endpoint = endpoint;
    ctx.events_endpoint =
        events_endpoint.empty() ? leasehold::default_events_endpoint(endpoint) : events_endpoint;
    ctx.timeout = leasehold::parse_duration(timeout_text);
    // Keys for whichever endpoint crosses the network (each socket uses
    // them only if its own does).
    ctx.curve = leasehold::client_curve_keys(
        leasehold::needs_curve(endpoint) ? endpoint : ctx.events_endpoint, curve_key,
        curve_server_key);
    ctx.json = output == "json";
    if (auto why = leasehold::ipc_permission_problem(endpoint)) {
      throw leasehold::Error(leasehold::ErrorCode::PermissionDenied, *why);
    }
    if (auto path = leasehold::ipc_path(endpoint); path && access(path->c_str(), F_OK) != 0) {
      throw std::runtime_error("no coordinator at " + endpoint + ": socket " + *path +
                               " does not exist (is leasehold-coordinator running? set "
                               "--endpoint or LEASEHOLD_ENDPOINT)");
    }
    if (*status) return run_status(ctx, output);
  } catch (const leasehold::Error& e) {
    std::cerr << "leasehold: " << e.what() << "\n";
    return leasehold::client::exit_code_of(e);
  } catch (const std::exception& e) {
    std::cerr << "leasehold: " << e.what() << "\n";
    return kExitUnreachable;
  }
  if (*submit) {
    // The coordinator answers a submission after checking the dataset files
    // (it gives that up to 10 s) and storing the job.
    if (!timeout_opt->count()) ctx.timeout = std::chrono::seconds(15);
    return leasehold::client::submit(ctx, *spec, follow);
  }
  if (*jobs) return leasehold::client::list_jobs(ctx);
  if (*job) return leasehold::client::show_job(ctx, id);
  if (*cancel) return leasehold::client::cancel_job(ctx, id);
  if (*logs) return leasehold::client::logs(ctx, id, follow);
  if (*checkpoint) {
    return leasehold::client::fetch_checkpoint(ctx, id, checkpoint_output, checkpoint_format);
  }
  if (*run) {
    // As for submit: the coordinator first checks the job's folder.
    if (!timeout_opt->count()) ctx.timeout = std::chrono::seconds(15);
    return leasehold::client::run_program(ctx, run_options);
  }
  if (*drop) return leasehold::client::drop_region(ctx, region_name);
  if (*regions) return leasehold::client::list_regions(ctx);
  return 0;
}
