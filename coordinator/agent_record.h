// What the coordinator knows about one registered agent.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "coordinator/agent_process.h"
#include "coordinator/job_table.h"
#include "schemas/leasehold_generated.h"
#include "shared/session_token.h"

namespace leasehold {

struct AgentRecord {
  std::string name;
  int pid = 0;  // as it declared (shown; its own PID namespace's)
  // Its process as the kernel named it on ipc:// (SO_PEERCRED), followed
  // from registration on. Only this is asked whether it still lives; null
  // for a network peer, whose pid says nothing about this host, so it is
  // dead only when it falls silent.
  std::shared_ptr<AgentProcess> process;
  // Leases and region attachments it still holds from an earlier session,
  // as it reports: while any is held, its fenced memory may still be
  // touched and stays fenced.
  uint32_t stale_holds = 0;
  // Who runs it (AttemptRecord::agent_identity): "uid N", "key NAME" or "".
  std::string identity;
  int device = -1;
  SessionToken session;               // token the agent must present (secret)
  SessionToken instance;              // what its process chose (Register.instance)
  std::set<std::string> routing_ids;  // its sockets (control, heartbeat)
  Clock::time_point last_seen;        // any valid message counts as a heartbeat;
                                      // in the future until the first one
  bool late = false;                  // silent past two heartbeats (logged once)
  bool takes_jobs = false;            // a standby worker (else it only leases)
  bool ignored_assignment = false;    // let one time out: no more jobs this session
  bool ready = true;                  // warmed up: a job it is given starts at once
  uint64_t outside_pool_bytes = 0;    // its device memory outside the pool, as it reports
  uint8_t mps_thread_percentage = 0;  // its MPS active-thread share (0: all)
  uint64_t job_id = 0;                // the job this coordinator gave it; 0: none
  // A program job's own session (its process registered it: Register.job_id):
  // that job, whose memory its leases are, within the job's budget. It
  // takes no job.
  uint64_t program_job = 0;
  uint32_t program_attempt = 0;  // and the attempt that started its process
  // The job whose memory this agent's leases are (its job, or its program
  // job's), if any.
  uint64_t memory_job() const { return program_job ? program_job : job_id; }
  // A device fault ended this agent's context (under MPS: every client's):
  // it restarts (and registers afresh), and gets no job until then, or
  // until the core gives up waiting (core_faults.cpp).
  bool context_lost = false;
  Clock::time_point context_lost_since{};
  // The jobs it reported in its latest Register or Heartbeat.
  std::vector<proto::AgentJobT> reported;
  // Last StopJob for each job it runs but should not (throttles resends).
  std::map<uint64_t, Clock::time_point> stray_stops;

  // The occupancy policy's conversation with it (coordinator/core_shrinks.cpp).
  struct PendingShrink {
    uint64_t id = 0;
    uint64_t job_id = 0;
    uint64_t bytes = 0;
    Clock::time_point sent;
    Clock::time_point deadline;
    bool missed = false;  // its deadline passed; it is skipped until it answers
  };
  std::optional<PendingShrink> shrink;
  // Not asked again before this (after an answer that released less than
  // asked: what it holds is in use now).
  Clock::time_point shrink_rest_until{};
  uint32_t shrinks_answered = 0;
  uint32_t shrinks_missed = 0;  // in a row
  uint64_t last_shrink_id = 0;  // the latest Shrink sent to it

  // True while it reports a job it has not stopped yet (queued, running or
  // stopping): such an agent takes no new job.
  bool reports_busy() const {
    for (const auto& r : reported) {
      if (r.phase != proto::JobPhase::Reporting) return true;
    }
    return false;
  }
  // What it is doing, as status and the metrics say; `leases`: how many it
  // holds.
  proto::AgentState state(size_t leases) const {
    if (program_job) return proto::AgentState::Program;
    if (job_id || reports_busy()) return proto::AgentState::Running;
    if (context_lost) return proto::AgentState::Restarting;
    if (takes_jobs && !ready) return proto::AgentState::Warming;
    return leases ? proto::AgentState::Leasing : proto::AgentState::Idle;
  }
  bool idle() const {
    // A late agent (silent past two heartbeats) keeps its session but gets
    // no new job until it is heard again: it may be hung.
    return takes_jobs && !ignored_assignment && ready && !late && !context_lost && job_id == 0 &&
           !reports_busy();
  }
};

}  // namespace leasehold
