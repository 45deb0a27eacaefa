// A program job (JobSpec.program; docs/program-jobs.md): the job's command,
// run as the agent's child (agent/program_process.h) with the environment
// its PyTorch plug-in needs to lease the job's memory through a session of
// its own; its output becomes the job's log, its reports (leasehold.report)
// the job's progress and epochs, its exit status the job's outcome.
#pragma once

#include <chrono>
#include <string>

#include "agent/job_kind.h"
#include "agent/python_standby.h"
#include "lease_client/session.h"

namespace leasehold {

struct ProgramJobOptions {
  // The coordinator's endpoint and, for a network one, the agent's CURVE
  // key files: the plug-in's session uses them.
  std::string endpoint;
  std::string curve_key, curve_server_key;
  // The folder holding the `leasehold` Python package and leasehold_site/
  // (its sitecustomize); empty: programs get neither.
  std::string python_dir;
  // The PyTorch plug-in (libleasehold_torch.so); empty: none here.
  std::string torch_plugin;
  // How long after SIGTERM a stopped program's group gets SIGKILL.
  std::chrono::milliseconds stop_grace{10000};
  // Warm standbys for Python scripts (agent/python_standby.h).
  PythonStandbyOptions standby;
};

// Fills what `options` leaves empty of the Python package's folder and the
// plug-in: from $LEASEHOLD_PYTHON_DIR and $LEASEHOLD_TORCH_PLUGIN, else
// beside the agent's program `argv0` (DIR/../share/leasehold/python and
// DIR/../lib/libleasehold_torch.so, an installation's and a bundle's
// layout), else the source tree's python/ (a build tree). Logs what it
// found.
void find_program_support(ProgramJobOptions& options, const char* argv0);

class ProgramJob final : public JobKind {
 public:
  // `session` outlives the object. Starts the Python standbys asked for.
  ProgramJob(AgentSession& session, ProgramJobOptions options);
  JobEnd run(const proto::JobSpec& job, JobAttempt& attempt) override;
  // Between jobs (the worker calls it often): keeps the standbys filled.
  void idle();

 private:
  // What every program job of this agent gets: the environment naming the
  // coordinator, the agent, the device, the plug-in and the MPS daemon,
  // and the Python path; none of a job's own.
  ProgramRun agent_run() const;

  AgentSession& session_;
  const ProgramJobOptions options_;
  PythonStandbys standbys_;
};

}  // namespace leasehold
