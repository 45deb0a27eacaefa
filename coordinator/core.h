// The coordinator's core: the agent registry, the lease table, the job table
// and scheduling, with every rule about them. It takes decoded requests and
// the current time and returns what to send, publish and store (Effects); it
// never touches a socket, a file or the clock (what it needs of the
// operating system, whether a pid lives, comes in CoreOptions), so unit
// tests drive it with a fake clock (tests/core_*_test.cpp).
// coordinator/broker.h is the transport around it.
//
// Jobs and their agents, in short:
// - A queued job starts on an idle agent: AssignJob is pushed (and pushed
//   again every heartbeat interval) until the agent's heartbeat lists it.
// - Agents list their jobs with a phase in every Register and Heartbeat. An
//   agent listing a job it should not run is told to stop it, and takes no
//   new job (nor does anyone take that job) until it has stopped.
// - An agent that dies loses its job back to the queue; the job resumes from
//   its last checkpoint on another agent, up to its max_attempts requeues,
//   then fails with every attempt's reason. An agent that falls silent while
//   its process lives on (hung, partitioned) may still be writing: its
//   leases are fenced (held back from everyone) and its job waits for it, up
//   to recovery_grace, before anything of it is given to someone else. The
//   same holds for an agent registering again after losing its session.
// - An agent whose heartbeat stops listing a job it had acknowledged (its
//   final report was lost) loses it back to the queue.
// - Final results and epoch reports are acknowledged once stored.
// - After a restart, jobs that were running wait for their agent: an agent
//   that registers without them, or none within recovery_grace, sends them
//   back to the queue ("coordinator restarted; resuming from epoch 3").
// - Devices: the core serves one pool per device (DeviceState); an agent is
//   bound to one device when it registers, and its leases, regions and
//   jobs are that device's. A queued job goes to the device where the
//   policy admits it with the most room left, unless it pins one
//   (coordinator/occupancy.md).
// - Memory: the scheduling policy (coordinator/scheduler.h) decides which
//   queued job starts, which lease may be granted and whom to ask to shrink;
//   the core sends Shrink, waits for ShrinkDone until shrink_timeout, skips
//   an agent that does not answer and drops one that stays silent
//   (core_shrinks.cpp).
// - Shared cache regions (core_regions.cpp, coordinator/regions.md): named
//   ranges of the pool agents attach to; the first attacher fills one while
//   the others wait; idle ones stay as a cache and are evicted, least
//   recently used first, when a waiting request or an admission needs the
//   memory. A filler that dies before the region is ready takes it along.
// - Device faults (core_faults.cpp): an agent whose GPU context was lost
//   reports its job interrupted with device_fault and restarts. Without MPS
//   the fault was the job's own: requeued, counted against max_attempts.
//   Under MPS one client's fault ends every client's context, so a fault
//   reported while other jobs ran (or other faults within fault_window) is
//   not counted; the jobs involved are requeued as suspects, and a suspect
//   runs alone until it reports an epoch or has run for fault_probation:
//   a fault then is its own and counts.
//
// Thread safety: none; one thread (the broker's loop) calls it.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <utility>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "coordinator/access.h"
#include "coordinator/agent_process.h"
#include "coordinator/agent_record.h"
#include "coordinator/device_state.h"
#include "coordinator/effects.h"
#include "coordinator/file_workers.h"
#include "coordinator/job_table.h"
#include "coordinator/scheduler.h"
#include "shared/chunk_channel.h"
#include "shared/device.h"

namespace leasehold {

// Milliseconds from `from` to `to`; 0 when `to` is not later.
inline uint64_t ms_between(Clock::time_point from, Clock::time_point to) {
  return to > from ? static_cast<uint64_t>(
                         std::chrono::duration_cast<std::chrono::milliseconds>(to - from).count())
                   : 0;
}

// The time, as the caller's clocks read it: steady for timeouts, Unix
// milliseconds for what is shown and stored.
struct Now {
  Clock::time_point steady;
  uint64_t unix_ms = 0;
  uint64_t unix_us = 0;  // the same instant in microseconds (job start time stamps)
};

struct CoreOptions {
  // Agents heart-beat at this interval. An agent whose process has exited
  // is dropped at once; one whose process is stopped (SIGSTOP, a debugger:
  // the kernel says so) and silent for two intervals has its leases fenced.
  std::chrono::milliseconds heartbeat_interval{1000};
  // Any other silent agent (slow on a saturated host, hung, or a network
  // agent whose process the coordinator cannot see) is fenced only after
  // this long, counting only the time the coordinator ran (stalled()).
  // Agents stop touching leased memory at 3/4 of it (RegisterAck).
  std::chrono::milliseconds silence_limit{10000};
  // How long a lease request that does not fit may wait by default.
  std::chrono::milliseconds lease_wait_timeout{30000};
  // Time a newly registered agent has before its first heartbeat: it
  // reserves the pool's range first, and creating a CUDA context can take
  // seconds when many agents start at once (seen: 32 agents on one H200).
  std::chrono::milliseconds first_heartbeat_grace{30000};
  // After a restart, how long a job found running waits for its agent to
  // come back before it is requeued anyway.
  std::chrono::milliseconds recovery_grace{10000};
  // How long an agent asked to shrink has to answer. One that has not
  // answered by then is skipped (others are asked); one still silent after
  // twice this is treated like a dead agent (its job requeued).
  std::chrono::milliseconds shrink_timeout{10000};
  // How long an agent has to acknowledge an assignment (its heartbeat lists
  // the job). One that does not (a fake agent, one stuck) has the job taken
  // back, uncharged, and gets no more jobs in its session. At least three
  // heartbeat intervals apply, whatever this says.
  std::chrono::milliseconds assign_timeout{10000};
  // How long an agent has to end a cancelled job. One that has not (it
  // acknowledges StopJob and runs on) has the job marked cancelled anyway
  // and gets no more jobs in its session.
  std::chrono::milliseconds stop_timeout{60000};
  // How long the checks of a submitted job's files may take.
  std::chrono::milliseconds file_check_timeout{10000};
  // The MPS daemon's pipe folder agents join (empty: no MPS).
  std::string mps_pipe_directory;
  // The chunk socket agents are told to fetch their memory from
  // (shared/chunk_channel.h); the broker serves it.
  std::string chunk_socket;
  // Device-fault reports this close together are one fault (agents notice
  // a lost context at their next wait for the device: within about a second).
  std::chrono::milliseconds fault_window{5000};
  // How long a suspect of a shared fault runs alone, unless it reports an
  // epoch first.
  std::chrono::milliseconds fault_probation{30000};
  // Jobs without a checkpoint directory get STATE_DIR/checkpoints/ID.
  std::string state_dir;
  // Finished jobs kept: at most this many, none older than retention_age.
  uint32_t retention_count = 1000;
  std::chrono::milliseconds retention_age{std::chrono::hours(24 * 30)};
  // Limits (each a coordinator option): jobs one user may have queued;
  // epochs and state changes kept per job (the oldest go; totals are
  // kept); lease requests one agent may have waiting.
  uint32_t queued_per_user = 1000;
  size_t epochs_kept = 1000;
  size_t history_kept = 100;
  uint32_t waiting_per_agent = 64;
  // The longest a lease or region request may ask to wait; a request asking
  // longer is refused naming the limit (max_lease_wait).
  std::chrono::milliseconds max_lease_wait{std::chrono::hours(24)};
  // The longest job accepted (max_epochs, max_steps).
  JobLengthLimits job_limits;
  // Jobs per ListJobs page (summaries stay far below the message size).
  uint32_t list_page_size = 200;
  // Who may register, submit and cancel (coordinator/access.h).
  AccessPolicy access;
  // Follows the process of an agent registering over ipc:// (the kernel's
  // pid and uid of the peer; coordinator/agent_process.h): asked whether it
  // exited, and ended when it hangs. Null for a peer it cannot follow.
  // Required.
  std::function<std::shared_ptr<AgentProcess>(const Peer&)> follow_process;
  // An agent silent for recovery_grace while its process lives (stopped,
  // hung) holds memory nobody may use until that process exits: the
  // coordinator SIGKILLs it when this is set and the process is its own
  // user's. Otherwise (or for another user's or a network agent) its leases
  // stay fenced until it exits or registers again, and status says so.
  bool end_silent_agents = true;
  // A TCP port free on this host, where a data-parallel job's rank 0 serves
  // its replicas' rendezvous (the broker asks the kernel for one, as
  // torchrun does). Null, or 0 returned: 29500 plus the job id modulo 1000.
  std::function<uint16_t()> free_port;
};

class CoordinatorCore {
 public:
  // `pools`: one per device it serves (distinct ordinals, one backend).
  CoordinatorCore(CoreOptions options, std::vector<PoolDescriptor> pools,
                  std::unique_ptr<SchedulingPolicy> policy, Now now);

  // Takes the jobs read from the store at start. Jobs that were running
  // wait for their agent (see above). Call before anything else.
  void recover(std::vector<JobRecord> jobs, uint64_t next_id, Now now, Effects& out);
  // Serves one verified request from the socket `routing_id`.
  // `peer`: who sent it, as the kernel says (coordinator/peer.h).
  void handle(const std::string& routing_id, const proto::Envelope& request, Now now, Effects& out,
              const Peer& peer = {});
  // The result of a FileCheck: the problems found (none: the job is valid).
  void file_check_done(uint64_t token, const std::vector<std::string>& problems, Now now,
                       Effects& out);
  // A piece of a checkpoint the file workers read (Effects::checkpoint_reads).
  void checkpoint_read_done(const FileWorkers::ReadResult& result, Effects& out);
  // Memory a program job's session had goes to nobody else before its
  // chunks have new memory (core_renewals.cpp): the renewals to run since
  // the last call, and the end of one (an empty `error`: the lease's memory
  // is free again; otherwise its chunks stay out of service, logged).
  std::vector<ChunkRenewal> take_chunk_renewals() { return std::exchange(renewals_, {}); }
  void chunks_renewed(int device, uint64_t lease_id, const std::string& error, Effects& out);
  // The caller's loop did not run for `gap` (the process was stopped or
  // starved, a disk stalled it): nobody could be heard then, so agents'
  // silence clocks and fences' grace are moved on by `gap`. Call before the
  // tick that follows the stall.
  void stalled(Clock::duration gap, Now now);
  // This start of the coordinator (RegisterAck, HeartbeatAck).
  const SessionToken& instance() const { return instance_; }
  // Housekeeping; call at least every heartbeat_interval / 4 and at
  // next_deadline(): purges silent agents, expires waiting requests and file
  // checks, resends unacknowledged pushes, requeues orphaned jobs, prunes.
  void tick(Now now, Effects& out);
  // The earliest time tick() has something to expire, if any.
  std::optional<Clock::time_point> next_deadline() const;
  // Device faults reported so far (the broker checks the MPS daemon when
  // this grows).
  uint64_t device_faults() const { return device_faults_; }
  // Jobs interrupted (requeued or ended by a cancel) since the start, by
  // cause (the metrics' counters).
  const std::map<Interruption, uint64_t>& interruptions() const { return interruptions_; }
  // The coordinator is stopping: tells every agent.
  void shutdown(Effects& out);
  // Non-empty while the job store cannot commit: submissions are refused
  // with this reason (nothing could be acknowledged).
  void set_store_error(std::string error) { store_error_ = std::move(error); }
  // The store failed before job `job_id`'s row was committed, and its
  // submitter has not been answered: the job is dropped (its row deleted)
  // and the submitter is to be refused (the transport answers, and drops
  // the job's held messages: OutMessage::job). A retry of the submission
  // (the same SubmitJob.key) then queues it once the store commits again.
  // False when there is no such job.
  bool withdraw_submission(uint64_t job_id, Now now, Effects& out);

  const std::map<std::string, AgentRecord>& agents() const { return agents_; }
  const JobTable& jobs() const { return jobs_; }
  // The devices, by ordinal.
  const std::map<int, DeviceState>& devices() const { return devices_; }
  // Device `ordinal`; throws std::out_of_range when it is not served.
  const DeviceState& device(int ordinal) const { return devices_.at(ordinal); }
  // Device `dev`'s pool as the policy sees it now.
  PoolView pool_view(const DeviceState& dev) const;
  // Which chunks the chunk socket may hand `req`'s asker (core_chunks.cpp):
  // those of a lease its session holds, read-write, or of a region it is
  // attached to, read-write for the filler and read-only for the others.
  // `peer_pid`: the asking process as the kernel named it; it must be the
  // agent's, where the coordinator follows its process. Else why not.
  std::variant<ChunkGrant, std::string> chunks_for(const ChunkRequest& req, int peer_pid) const;
  // "3 agents, 5 leases, 1.00 GiB of 4.00 GiB leased, 2 jobs queued, 1 running"
  std::string summary() const;
  // What a Status request is answered with (also the HTTP endpoint's
  // /api/status and the metrics).
  proto::StatusReplyT status(Now now) const;

 private:
  // A submission whose files are being checked.
  struct PendingSubmit {
    std::string routing_id;
    uint64_t request_id = 0;
    std::shared_ptr<proto::JobSpecT> spec;
    Clock::time_point deadline;
    Peer submitter;
    std::string key;  // submit_keys_'s, empty without SubmitJob.key
  };
  // How a dropped agent's job and leases go on.
  enum class JobFate {
    AgentLost,  // job requeued and counted against max_attempts; leases freed
    Requeue,    // job requeued, not counted (the agent left in order); leases freed
    Orphan,     // it registers again right now: its report decides; leases fenced
    Silent,     // silent but alive: job waits (counted if it never says), leases fenced
  };
  // Leases of an agent that may still be writing into them: given to
  // nobody until its process has exited, or until the agent, registered
  // again, reports that it holds nothing of its old session any more.
  struct Fence {
    int device = 0;                         // whose lease table holds them
    std::shared_ptr<AgentProcess> process;  // null: not followed (a network agent)
    int pid = 0;                            // as the agent declared it (shown)
    Clock::time_point since;
    // After recovery_grace: killed (end_silent_agents), or held until it
    // exits (why_held says why it was not ended).
    enum class End { Waiting, Killed, Held };
    End end = End::Waiting;
    std::string why_held;
    bool renew = false;  // a program job's session: its chunks get new memory first
  };

  void dispatch(const std::string& rid, const proto::Envelope& env, Now now, Effects& out,
                const Peer& peer);
  void on_register(const std::string& rid, const proto::Envelope& env, Now now, Effects& out,
                   const Peer& peer);
  void on_lease_request(const std::string& rid, AgentRecord& agent, const proto::Envelope& env,
                        Now now, Effects& out);
  void on_status(const std::string& rid, uint64_t req, Now now, Effects& out);
  // Grants waiting requests the pool and the policy allow (at now_), on
  // `dev` or on every device.
  void serve_waiting(DeviceState& dev, Effects& out);
  void serve_waiting(Effects& out);
  bool admit(const DeviceState& dev, const PendingRequest& request);
  // The device `agent` is bound to.
  DeviceState& device_of(const AgentRecord& agent) { return devices_.at(agent.device); }
  const DeviceState& device_of(const AgentRecord& agent) const { return devices_.at(agent.device); }
  // The device a registering agent asking for `wanted` (-1: any) gets, or
  // why none: one not served is refused; any is the one with the fewest
  // agents that take jobs.
  std::variant<int, std::string> bind_device(int wanted, bool takes_jobs) const;
  void purge_dead_agents(Now now, Effects& out);
  void drop_agent(const std::string& name, const std::string& why, JobFate fate, Now now,
                  Effects& out);
  void release_fence(const std::string& agent, const std::string& why, Effects& out);
  // Gives `owner`'s leases on `dev` back (all, or `lease_id`'s, checked as
  // LeaseTable::release checks): free at once, or, `renew`, held by
  // LeaseOwner::renewing(`who`: the agent's name, or "region NAME") until
  // their chunks have new memory
  // (core_renewals.cpp). Returns the count and bytes, or the refusal.
  std::variant<std::pair<size_t, uint64_t>, Refusal> give_back(
      DeviceState& dev, const LeaseOwner& owner, bool renew, const std::string& who,
      std::optional<uint64_t> lease_id = std::nullopt);
  // Lease `lease_id` of `dev` (held by LeaseOwner::renewing) has its chunks
  // renewed off the loop (take_chunk_renewals).
  void renew_later(const DeviceState& dev, uint64_t lease_id);
  // Releases fences whose process exited; ends (end_silent_agents) the
  // processes silent past recovery_grace.
  void check_fences(Now now, Effects& out);
  // What status says of `agent`'s fence: why its memory is still held.
  std::string fence_state(const std::string& agent, const Fence& f, Now now) const;
  // Silence after which an agent's leases are fenced: two heartbeats for a
  // stopped process, CoreOptions::silence_limit for any other.
  std::chrono::milliseconds silence_limit() const {
    return std::max(opts_.silence_limit, 2 * opts_.heartbeat_interval);
  }
  std::chrono::milliseconds stopped_limit() const { return 2 * opts_.heartbeat_interval; }

  // Shared cache regions (core_regions.cpp).
  void on_attach_region(const std::string& rid, AgentRecord& agent, const proto::Envelope& env,
                        Now now, Effects& out);
  void on_region_ready(const std::string& rid, AgentRecord& agent, const proto::Envelope& env,
                       Now now, Effects& out);
  void on_detach_region(const std::string& rid, AgentRecord& agent, const proto::Envelope& env,
                        Now now, Effects& out);
  void on_list_regions(const std::string& rid, uint64_t req, Effects& out);
  void on_drop_region(const std::string& rid, const proto::Envelope& env, Now now, Effects& out,
                      const Peer& peer);
  // Why a new region of `bytes` cannot be placed even after every idle
  // region (and `also_free` more) went; empty when it might be.
  std::string cache_refusal(const DeviceState& dev, uint64_t bytes, uint64_t also_free = 0) const;
  // Whether the followed `process` (null: not followed) has exited.
  static bool gone(const std::shared_ptr<AgentProcess>& process) {
    return process && process->gone();
  }
  // Whether `agent` runs as the one `job`'s current attempt was given to
  // (an attempt recorded without an identity matches any).
  static bool runs_as(const JobRecord& job, const AgentRecord& agent) {
    return job.attempts.empty() || job.attempts.back().agent_identity.empty() ||
           job.attempts.back().agent_identity == agent.identity;
  }
  // Why the Register `r` of a program job's session is refused (no such
  // running program job and attempt, a wrong token, another name or user
  // than its agent's); none when it may register.
  std::optional<std::string> program_session_refusal(const proto::Register& r,
                                                     const std::string& name,
                                                     const std::string& identity) const;
  // Why a lease of `bytes` more for `agent` is refused: a program job's
  // session past its job's memory budget (what it holds and waits for
  // counted); none when it may have it.
  std::optional<std::string> budget_refusal(const AgentRecord& agent, uint64_t bytes) const;
  // The running job whose memory `agent`'s leases are, for the policy's
  // view: a program job's memory is its session's (once registered), not
  // its agent's. Null for none.
  const JobRecord* managed_job(const AgentRecord& agent) const;
  // Whether program session `session` belongs to `job`'s running attempt.
  static bool is_current(const JobRecord& job, const AgentRecord& session);
  // Drops `job`'s program session, if one is registered, its leases fenced
  // until its process exits (its attempt ended: finish, requeue).
  void end_program_session(const JobRecord& job, const std::string& why, Now now, Effects& out);
  // Why a Register or Heartbeat listing `jobs` is refused (more than an
  // agent can have); none when it is not.
  static std::optional<std::string> reported_jobs_refusal(
      const flatbuffers::Vector<flatbuffers::Offset<proto::AgentJob>>* jobs);
  // Why `agent` may not wait `wait_ms` for memory or a region: longer than
  // max_lease_wait (InvalidArgument), or waiting_per_agent requests already
  // waiting (NoSpace). None when it may.
  std::optional<Refusal> wait_refusal(const std::string& agent, int64_t wait_ms) const;
  // Places the new region `rec` (memory from the high end, after evicting
  // idle regions if that makes room); an empty string on success, else why not.
  std::string place_region(DeviceState& dev, RegionRecord& rec, uint64_t size, Now now);
  // Gives `agent` an attachment to `rec` and answers `to` with the grant.
  void grant_region(RegionRecord& rec, const std::string& agent, const ReplyTo& to, bool fill,
                    Now now, Effects& out);
  // Frees (or, `to_agent` non-empty, hands to that agent) a region's memory.
  void free_region_memory(RegionRecord& rec, const std::string& to_agent = "");
  void evict_region(RegionRecord& rec, const std::string& why, Now now);
  // A filling region whose filler is gone: its waiters fill it again or fail.
  void discard_region(DeviceState& dev, const std::string& name, const std::string& why, Now now,
                      Effects& out);
  // Drops the attachments and waiters of an agent that goes. A region it
  // was filling loses its memory to the agent's own leases (so it is
  // fenced with them when the agent may still be writing); returns those
  // regions, to be discarded once the agent's leases are dealt with.
  std::vector<std::string> drop_region_users(DeviceState& dev, const std::string& agent, Now now);
  void expire_region_waiters(Now now, Effects& out);
  // Whether evicting idle regions could let a waiting lease request be
  // granted: one that is not speculative growth, no larger than the free
  // memory plus the idle regions.
  bool eviction_could_serve(const DeviceState& dev) const;
  // Evicts idle regions, least recently used first, for the part of `job`'s
  // guaranteed share that admission counted on them (the job may pin one of
  // them itself by attaching its dataset).
  void evict_for_admission(DeviceState& dev, const JobRecord& job, Now now);

  // Memory (core_shrinks.cpp).
  // Sends the Shrinks the policy asks for now.
  void request_shrinks(Now now, Effects& out);
  void on_shrink_done(const std::string& rid, AgentRecord& agent, const proto::Envelope& env,
                      Now now, Effects& out);
  // Skips agents past their Shrink deadline; drops those silent for twice it.
  void check_shrinks(Now now, Effects& out);
  // Adds the time a granted request of `owner` waited to its job.
  void note_lease_wait(const LeaseOwner& owner, Clock::time_point since, Now now, Effects& out);
  // Ends a queued job's wait for memory, adding its time to the job.
  static void end_memory_wait(JobRecord& job, Now now);
  // Sets why the job first in line (`head`; null: none) waits (`refused`:
  // the policy's answer for it, if it was asked) and why the one first
  // before it waits now; publishes what changed and counts time waiting
  // for memory.
  void note_waiting(JobRecord* head, const Pick& refused, Now now, Effects& out);
  // Sets `job`'s guaranteed share and budget from its spec, shares of a
  // pool resolved against one of `pool_size` bytes.
  static void note_shares(JobRecord& job, uint64_t pool_size);
  // The largest pool: what a job's shares are resolved against until it
  // is placed (its own device's then).
  uint64_t largest_pool() const;
  // Jobs (core_jobs.cpp).
  void on_submit(const std::string& rid, const proto::Envelope& env, Now now, Effects& out,
                 const Peer& peer);
  void on_list_jobs(const std::string& rid, const proto::Envelope& env, Effects& out);
  void on_get_job(const std::string& rid, const proto::Envelope& env, Effects& out,
                  const Peer& peer);
  void on_cancel(const std::string& rid, const proto::Envelope& env, Now now, Effects& out,
                 const Peer& peer);
  void on_job_update(const std::string& rid, AgentRecord& agent, const proto::Envelope& env,
                     Now now, Effects& out);
  // A job's checkpoint file, in pieces, for its owner (core_checkpoints.cpp):
  // read by the file workers, answered when they are done or too late.
  struct PendingRead {
    std::string routing_id;
    uint64_t request_id = 0;
    uint64_t job_id = 0;
    std::string name;
    int32_t epoch = 0;
    uint64_t offset = 0;
    Clock::time_point deadline;
  };
  void on_get_checkpoint(const std::string& rid, const proto::Envelope& env, Now now, Effects& out,
                         const Peer& peer);
  void expire_checkpoint_reads(Now now, Effects& out);
  void on_get_job_log(const std::string& rid, const proto::Envelope& env, Effects& out,
                      const Peer& peer);
  // Appends a program job's output chunk (JobUpdate.log at `offset` of
  // this attempt's output) to `job`'s log.
  static void append_log(JobRecord& job, std::string_view chunk, uint64_t offset);
  // Takes the jobs an agent lists in a Register or Heartbeat.
  void reconcile(AgentRecord& agent, const proto::Register* reg, const proto::Heartbeat* hb,
                 Now now, Effects& out);
  void schedule(Now now, Effects& out);
  struct FaultRules;  // below (device faults)
  // Where `job` starts now: an idle agent on a device it may run on, not
  // in `blocked`, where the policy admits it with the most room left (for
  // a data-parallel job, one on each of the best `replicas` devices, by
  // rank); or none, with the policy's refusal if one was asked.
  struct Placement {
    std::vector<AgentRecord*> agents;
    Pick refused;
  };
  Placement place(JobRecord& job, const std::set<int>& blocked, const FaultRules& rules);
  // Whether `job` could ever run on `dev`: its `device`, its budget and
  // guaranteed share resolved against that pool (set in `job`), and a
  // parameter region it starts from, if resident somewhere.
  bool could_run_on(JobRecord& job, const DeviceState& dev) const;
  // Starts the next attempt of `job` on `agents` (one per replica, by rank).
  void assign(JobRecord& job, const std::vector<AgentRecord*>& agents, Now now, Effects& out);
  // AssignJob for the replica of `job` that `agent` runs.
  void push_assign(const JobRecord& job, const AgentRecord& agent, Effects& out);
  // A data-parallel job's attempt ends: StopJob (for `reason`) to the
  // replicas still running it, so the gang stops as one.
  void stop_replicas(const JobRecord& job, const std::string& reason, Effects& out);
  // `cancel`: the user's cancel (else the coordinator wants it stopped, for
  // `reason`). After the store when it acts on a stored state.
  void push_stop(uint64_t job_id, uint32_t attempt, bool cancel, const std::string& reason,
                 const AgentRecord& agent, Effects& out, bool after_store);
  void resend_pushes(Now now, Effects& out);
  // The running `job` stopped without finishing: back to the queue (or
  // cancelled when that was asked, or failed after too many counted
  // failures). `counts`: a lost agent or the job's own device fault, ended
  // as `outcome` (default "agent lost"); else "interrupted".
  // `cause` is counted in the job and in interruptions().
  void requeue(JobRecord& job, Interruption cause, const std::string& why, bool counts, Now now,
               Effects& out, const std::string& outcome = "agent lost");
  // Device faults (core_faults.cpp).
  // The final report of `job`, interrupted by a device fault on `agent`.
  void on_device_fault(JobRecord& job, AgentRecord& agent, const std::string& reason, Now now,
                       Effects& out);
  // What the suspects allow the scheduler now (taken once per schedule()).
  // A fault under MPS ends the contexts on its GPU only, so the rules are
  // per device.
  struct FaultRules {
    bool active = false;                     // under MPS
    std::set<int> running, suspect_running;  // devices
    bool suspect_queued = false;
    // A suspect starts only on a device where nothing runs, nothing starts
    // beside one, and while one waits nothing else starts (the GPUs drain
    // for it).
    bool allow(const JobRecord& job, int device) const;
    bool allow_anywhere(const JobRecord& job, const std::map<int, DeviceState>& devices) const;
    void started(const JobRecord& job, int device);  // `job` was just assigned there
  };
  FaultRules fault_rules() const;
  // The device `job` runs on (its agent's); nullopt when its agent is gone.
  std::optional<int> device_of(const JobRecord& job) const;
  // Marks `job` a suspect of a shared fault, or clears it (suspects_).
  void set_suspect(JobRecord& job, bool suspect);
  // A suspect that ran for fault_probation is cleared; so is an agent
  // marked context_lost that did not restart.
  void end_probations(Now now, Effects& out);
  void finish(JobRecord& job, JobState state, const std::string& reason, Now now, Effects& out);
  // Closes the running attempt and unbinds the job from its agent.
  void end_attempt(JobRecord& job, const std::string& outcome, const std::string& reason, Now now);
  std::string store_refusal() const;
  // Why `peer` may not `what` ("cancel", "read the log of") `job`: neither
  // its submitter nor an administrator (logged); none when it may.
  std::optional<std::string> owner_refusal(const JobRecord& job, const Peer& peer,
                                           const std::string& what) const;
  // The index of a submission's key in submit_keys_: its submitter's and
  // the key (two users' keys never meet).
  static std::string submit_key_of(const std::string& identity, const std::string& key) {
    return identity + '\n' + key;
  }
  void release_orphans(Now now, Effects& out);
  void expire_file_checks(Now now, Effects& out);
  void prune(Now now, Effects& out);
  void changed(const JobRecord& job, Effects& out);  // store and publish
  // Whether a job asking for `device` (auto, cuda, cpu, or one of those
  // with ":N" pinning ordinal N) can run on `dev`, and on any device served.
  static bool device_fits(const std::string& device, const DeviceState& dev);
  bool device_fits_any(const std::string& device) const;
  static std::string job_label(const JobRecord& job);  // "job 3 'mlp'"
  // STATE_DIR/checkpoints/ID: the folder of the job's own (an agent
  // creates it, mode 0700).
  std::string private_checkpoint_dir(uint64_t id) const {
    return opts_.state_dir + "/checkpoints/" + std::to_string(id);
  }

  CoreOptions opts_;
  std::map<int, DeviceState> devices_;  // by ordinal
  std::unique_ptr<SchedulingPolicy> policy_;
  JobTable jobs_;
  std::map<std::string, AgentRecord> agents_;
  std::map<uint64_t, PendingSubmit> pending_submits_;
  std::map<uint64_t, PendingRead> pending_reads_;  // by CheckpointRead::token
  // Jobs by their submitter's identity and SubmitJob.key (submit_key_of).
  std::map<std::string, uint64_t> submit_keys_;
  // Program jobs' sessions: job id -> the sessions' agent names (one per
  // replica).
  std::multimap<uint64_t, std::string> program_sessions_;
  std::map<std::string, Fence> fences_;  // by agent name
  std::vector<ChunkRenewal> renewals_;   // to run (take_chunk_renewals)
  const SessionToken instance_ = SessionToken::random();
  std::map<Interruption, uint64_t> interruptions_;
  uint64_t next_check_token_ = 1;
  uint64_t next_shrink_id_ = 1;
  // The time of the call being served (for what serve_waiting grants).
  Now now_;
  Clock::time_point started_;
  std::optional<Clock::time_point> last_prune_;
  // The latest device fault of each device: when its first report came,
  // and the jobs that were running on the device then, with their attempts
  // (its later reports come from those attempts).
  struct FaultIncident {
    Clock::time_point opened;
    std::map<uint64_t, uint32_t> jobs;
  };
  std::map<int, FaultIncident> incidents_;  // by device
  // The job note_waiting found first in line (0: none).
  uint64_t head_ = 0;
  // Jobs that are fault suspects (JobRecord::fault_suspect), by id.
  std::set<uint64_t> suspects_;
  uint64_t device_faults_ = 0;
  std::string store_error_;
};

}  // namespace leasehold
