// What /metrics shows: a snapshot the poll loop takes of the core (plain
// values, no references into it) and its rendering in the Prometheus text
// format by prometheus-cpp's serializer. Every series of one device (its
// pool, leases, agents, regions, and the jobs running on it) carries the
// labels `gpu` and `UUID` exactly as NVIDIA's DCGM exporter writes them, so
// a query can join Leasehold's series with DCGM's on the same GPU (on the
// host backend: the segment's ordinal and "host-N"). Series of the whole
// coordinator (jobs by state, interruptions, faults, uptime) carry neither.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "coordinator/lease_stats.h"
#include "schemas/leasehold_generated.h"

namespace leasehold {

class CoordinatorCore;

// What a program job's allocator plug-in reported last.
struct ProgramSeries {
  uint64_t in_use_bytes = 0, allocations = 0, cache_hits = 0, lease_requests = 0;
  uint64_t outside_pool_bytes = 0;
};

// A running job's series, labelled job_id, name and agent (not "job":
// Prometheus keeps that label for its scrape job).
struct JobSeries {
  std::string gpu, uuid;  // of the device it runs on
  uint64_t id = 0;
  std::string name, agent;
  std::string user;            // who submitted it (the `user` label)
  uint32_t interruptions = 0;  // attempts that ended without finishing
  double samples_per_second = 0;
  double loss = 0;
  double test_accuracy = -1;  // the latest epoch's; < 0: no epoch reported yet
  uint64_t leased_bytes = 0;  // what it holds in the pool now (agent and program)
  uint64_t peak_bytes = 0;    // the most its allocator leased at once
  uint64_t spill_bytes = 0;   // in its spill store now (pinned host + file)
  uint64_t spilled_bytes = 0, restored_bytes = 0;  // moved since it started
  uint32_t shrinks = 0;                            // Shrinks its agents answered
  uint64_t shrunk_bytes = 0;                       // and the bytes they gave back
  std::optional<ProgramSeries> program;            // a program job's
};

// One device's series.
struct DeviceSeries {
  std::string gpu, uuid;  // the labels: "0" and "GPU-…" ("0" and "host-0" on the host backend)
  uint64_t pool_bytes = 0, used_bytes = 0, free_bytes = 0, largest_free_bytes = 0;
  uint32_t free_blocks = 0;
  double occupancy = 0;
  uint64_t leases_held = 0, region_leases = 0, requests_waiting = 0;
  std::map<std::string, uint64_t> agents_by_state;  // every known state, 0 included
  LeaseStats lease_stats;
  uint64_t regions_resident = 0, region_bytes = 0;
  uint64_t region_hits = 0, region_misses = 0, region_evictions = 0;
};

struct MetricsSnapshot {
  std::vector<DeviceSeries> devices;  // by ordinal
  std::map<std::string, uint64_t> jobs_by_state;
  // Jobs interrupted since the coordinator started, by cause (every cause,
  // 0 included: interruption_name).
  std::map<std::string, uint64_t> interruptions;
  std::vector<JobSeries> running;
  uint64_t device_faults = 0;
  double uptime_seconds = 0;
};

// Takes the snapshot; `status` is what core.status() returned this turn.
MetricsSnapshot take_metrics_snapshot(const CoordinatorCore& core,
                                      const proto::StatusReplyT& status);

// The Prometheus text exposition format (version 0.0.4).
std::string render_metrics(const MetricsSnapshot& snapshot);

}  // namespace leasehold
