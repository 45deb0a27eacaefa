#include "coordinator/metrics.h"

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <cmath>
#include <limits>

#include "coordinator/core.h"
#include "shared/printable.h"
#include "shared/protocol.h"

namespace leasehold {
namespace {

// States that always have a series (at 0 when empty), so a panel or an
// alert on one does not see it vanish.
constexpr proto::AgentState kAgentStates[] = {
    proto::AgentState::Idle,    proto::AgentState::Leasing,    proto::AgentState::Running,
    proto::AgentState::Warming, proto::AgentState::Restarting, proto::AgentState::Program};

using Labels = std::vector<prometheus::ClientMetric::Label>;

Labels device_labels(const std::string& gpu, const std::string& uuid) {
  return {{"gpu", gpu}, {"UUID", uuid}};
}

// Builds the families, a series at a time.
class Families {
 public:
  void gauge(const char* name, const char* help, double value, Labels labels = {}) {
    family(name, help, prometheus::MetricType::Gauge).metric.push_back(point(labels));
    out_.back().metric.back().gauge.value = value;
  }
  void counter(const char* name, const char* help, double value, Labels labels = {}) {
    family(name, help, prometheus::MetricType::Counter).metric.push_back(point(labels));
    out_.back().metric.back().counter.value = value;
  }
  void histogram(const char* name, const char* help, const LeaseStats& s, Labels labels) {
    auto& m = family(name, help, prometheus::MetricType::Histogram).metric;
    m.push_back(point(labels));
    auto& h = m.back().histogram;
    h.sample_count = s.grants;
    h.sample_sum = s.waited_seconds;
    uint64_t cumulative = 0;
    for (size_t i = 0; i < LeaseStats::kBounds.size(); ++i) {
      cumulative += s.buckets[i];
      h.bucket.push_back({cumulative, LeaseStats::kBounds[i]});
    }
    h.bucket.push_back({s.grants, std::numeric_limits<double>::infinity()});
  }
  std::vector<prometheus::MetricFamily>& families() { return out_; }

 private:
  // Consecutive calls with the same name add series to one family.
  prometheus::MetricFamily& family(const char* name, const char* help,
                                   prometheus::MetricType type) {
    if (out_.empty() || out_.back().name != name) {
      out_.push_back(prometheus::MetricFamily{name, help, type, {}});
    }
    return out_.back();
  }
  static prometheus::ClientMetric point(Labels labels) {
    prometheus::ClientMetric m;
    m.label = std::move(labels);
    // Prometheus refuses a whole scrape over one label value that is not
    // UTF-8 (a job name is the submitter's bytes).
    for (auto& l : m.label) l.value = printable(l.value);
    return m;
  }

  std::vector<prometheus::MetricFamily> out_;
};

}  // namespace

MetricsSnapshot take_metrics_snapshot(const CoordinatorCore& core,
                                      const proto::StatusReplyT& status) {
  MetricsSnapshot s;
  s.uptime_seconds = double(status.uptime_ms) / 1000;
  std::map<int, size_t> index;  // ordinal -> s.devices
  for (const auto& d : status.devices) {
    if (!d->pool || !d->pool->info) continue;
    const int ordinal = d->pool->info->device;
    const DeviceState& dev = core.device(ordinal);
    index[ordinal] = s.devices.size();
    DeviceSeries& ds = s.devices.emplace_back();
    ds.gpu = std::to_string(ordinal);
    ds.uuid = d->pool->info->uuid;
    ds.pool_bytes = d->pool->info->size;
    ds.used_bytes = d->pool->used_bytes;
    ds.free_bytes = d->pool->free_bytes;
    ds.largest_free_bytes = d->pool->largest_free_bytes;
    ds.free_blocks = d->pool->free_blocks;
    ds.occupancy = d->occupancy    ? d->occupancy->occupancy
                   : ds.pool_bytes ? double(ds.used_bytes) / double(ds.pool_bytes)
                                   : 0;
    ds.requests_waiting = d->pending_requests;
    for (proto::AgentState state : kAgentStates) ds.agents_by_state[agent_state_name(state)] = 0;
    for (const auto& [name, region] : dev.regions.all()) {
      if (region.lease_id == 0) continue;
      ++ds.regions_resident;
      ++ds.region_leases;
      ds.region_bytes += region.lease_bytes;
    }
    ds.region_hits = dev.regions.hits;
    ds.region_misses = dev.regions.misses;
    ds.region_evictions = dev.regions.evictions;
    ds.lease_stats = dev.stats;
  }
  for (const auto& l : status.leases) {
    if (auto it = index.find(l->device);
        it != index.end() && l->holder != proto::LeaseHolder::Region) {
      ++s.devices[it->second].leases_held;
    }
  }
  // A job's memory: its agent's leases, and a program job's also those of
  // its program's own session (an entry of its own, carrying the job's id).
  std::map<uint64_t, uint64_t> leased_by_job;
  std::map<std::string, int> device_of_agent;
  for (const auto& a : status.agents) {
    device_of_agent[a->name] = a->device;
    if (auto it = index.find(a->device); it != index.end()) {
      ++s.devices[it->second].agents_by_state[agent_state_name(a->state)];
    }
    if (a->job_id) leased_by_job[a->job_id] += a->leased_bytes;
  }

  for (JobState state : {JobState::Queued, JobState::Running, JobState::Succeeded, JobState::Failed,
                         JobState::Cancelled}) {
    s.jobs_by_state[job_state_name(state)] = core.jobs().count(state);
  }
  for (uint64_t id : core.jobs().running()) {
    const JobRecord& job = *core.jobs().find(id);
    JobSeries j;
    if (auto a = device_of_agent.find(job.agent); a != device_of_agent.end()) {
      if (auto it = index.find(a->second); it != index.end()) {
        j.gpu = s.devices[it->second].gpu;
        j.uuid = s.devices[it->second].uuid;
      }
    }
    j.id = id;
    j.name = job.name;
    j.agent = job.agent;
    j.user = job.submitted_by;
    for (const auto& [cause, n] : job.interruptions) j.interruptions += n;
    j.samples_per_second = job.progress.samples_per_second;
    j.loss = job.progress.loss;
    if (!job.epochs.empty()) j.test_accuracy = job.epochs.back().test_accuracy;
    auto held = leased_by_job.find(id);
    j.leased_bytes = held == leased_by_job.end() ? 0 : held->second;
    if (job.is_program()) {
      const proto::ProgramMemoryT& m = job.program_memory;
      j.program = ProgramSeries{m.in_use_bytes, m.allocations, m.cache_hits, m.lease_requests,
                                m.outside_pool_bytes};
    }
    j.peak_bytes = job.progress.peak_device_bytes;
    j.spill_bytes = job.progress.spill_host_bytes + job.progress.spill_file_bytes;
    j.spilled_bytes = job.progress.spilled_bytes;
    j.restored_bytes = job.progress.restored_bytes;
    j.shrinks = job.shrinks;
    j.shrunk_bytes = job.shrunk_bytes;
    s.running.push_back(std::move(j));
  }
  for (Interruption i : kInterruptions) {
    auto it = core.interruptions().find(i);
    s.interruptions[std::string(interruption_name(i))] =
        it == core.interruptions().end() ? 0 : it->second;
  }
  s.device_faults = core.device_faults();
  return s;
}

std::string render_metrics(const MetricsSnapshot& s) {
  Families f;
  // One family at a time (the text format wants a family's series
  // together), a series per device.
  auto per_device = [&](auto add) {
    for (const auto& d : s.devices) add(d, device_labels(d.gpu, d.uuid));
  };
  auto device_gauge = [&](const char* name, const char* help, auto value) {
    per_device([&](const DeviceSeries& d, Labels l) { f.gauge(name, help, value(d), l); });
  };
  auto device_counter = [&](const char* name, const char* help, auto value) {
    per_device([&](const DeviceSeries& d, Labels l) { f.counter(name, help, value(d), l); });
  };
  device_gauge("leasehold_pool_size_bytes", "Size of the pool",
               [](const DeviceSeries& d) { return double(d.pool_bytes); });
  device_gauge("leasehold_pool_used_bytes", "Bytes of the pool leased (agents and regions)",
               [](const DeviceSeries& d) { return double(d.used_bytes); });
  device_gauge("leasehold_pool_free_bytes", "Bytes of the pool not leased",
               [](const DeviceSeries& d) { return double(d.free_bytes); });
  device_gauge("leasehold_pool_largest_free_block_bytes", "Largest free block of the pool",
               [](const DeviceSeries& d) { return double(d.largest_free_bytes); });
  device_gauge("leasehold_pool_free_blocks", "Free blocks of the pool (fragmentation)",
               [](const DeviceSeries& d) { return double(d.free_blocks); });
  device_gauge("leasehold_pool_occupancy_ratio", "Leased bytes / pool size",
               [](const DeviceSeries& d) { return d.occupancy; });
  per_device([&](const DeviceSeries& d, Labels l) {
    for (auto [state, n] : {std::pair{"held", d.leases_held},
                            {"region", d.region_leases},
                            {"waiting", d.requests_waiting}}) {
      Labels with = l;
      with.push_back({"state", state});
      f.gauge("leasehold_leases", "Leases by state", double(n), std::move(with));
    }
  });
  per_device([&](const DeviceSeries& d, Labels l) {
    for (const auto& [state, n] : d.agents_by_state) {
      Labels with = l;
      with.push_back({"state", state});
      f.gauge("leasehold_agents", "Agents by state", double(n), std::move(with));
    }
  });
  device_counter("leasehold_lease_grants_total", "Lease requests granted",
                 [](const DeviceSeries& d) { return double(d.lease_stats.grants); });
  device_counter("leasehold_lease_refusals_total", "Lease requests refused at once",
                 [](const DeviceSeries& d) { return double(d.lease_stats.refusals); });
  device_counter("leasehold_lease_timeouts_total",
                 "Lease requests refused after waiting until their deadline",
                 [](const DeviceSeries& d) { return double(d.lease_stats.timeouts); });
  per_device([&](const DeviceSeries& d, Labels l) {
    f.histogram("leasehold_lease_grant_latency_seconds",
                "Time a granted lease request waited for memory", d.lease_stats, std::move(l));
  });
  for (const auto& [state, n] : s.jobs_by_state) {
    f.gauge("leasehold_jobs", "Jobs by state", double(n), {{"state", state}});
  }
  for (const auto& [cause, n] : s.interruptions) {
    f.counter("leasehold_job_interruptions_total",
              "Running jobs interrupted and requeued (or ended), by cause", double(n),
              {{"cause", cause}});
  }
  // One family at a time: the text format wants a family's series together.
  auto per_job = [&](const char* name, const char* help, bool counter, auto value) {
    for (const auto& j : s.running) {
      if (std::isnan(value(j))) continue;  // nothing to show yet
      Labels labels = device_labels(j.gpu, j.uuid);
      labels.insert(labels.end(), {{"job_id", std::to_string(j.id)},
                                   {"name", j.name},
                                   {"agent", j.agent},
                                   {"user", j.user}});
      if (counter) {
        f.counter(name, help, value(j), std::move(labels));
      } else {
        f.gauge(name, help, value(j), std::move(labels));
      }
    }
  };
  per_job("leasehold_job_samples_per_second", "Training throughput of a running job", false,
          [](const JobSeries& j) { return j.samples_per_second; });
  per_job("leasehold_job_loss", "Latest training loss of a running job", false,
          [](const JobSeries& j) { return j.loss; });
  per_job("leasehold_job_test_accuracy_ratio", "Test accuracy of the latest epoch (0..1)", false,
          [](const JobSeries& j) { return j.test_accuracy < 0 ? NAN : j.test_accuracy; });
  per_job("leasehold_job_leased_bytes", "Pool bytes the job's agent holds", false,
          [](const JobSeries& j) { return double(j.leased_bytes); });
  per_job("leasehold_job_peak_bytes", "Most device memory the job's allocator leased at once",
          false, [](const JobSeries& j) { return double(j.peak_bytes); });
  per_job("leasehold_job_spill_bytes", "Bytes of the job in its spill store now", false,
          [](const JobSeries& j) { return double(j.spill_bytes); });
  per_job("leasehold_job_spilled_bytes_total", "Bytes the job spilled out of the pool", true,
          [](const JobSeries& j) { return double(j.spilled_bytes); });
  per_job("leasehold_job_restored_bytes_total", "Bytes the job restored into the pool", true,
          [](const JobSeries& j) { return double(j.restored_bytes); });
  per_job("leasehold_job_shrinks_total", "Shrinks the job's agents answered", true,
          [](const JobSeries& j) { return double(j.shrinks); });
  per_job("leasehold_job_shrunk_bytes_total", "Bytes the job's Shrinks gave back", true,
          [](const JobSeries& j) { return double(j.shrunk_bytes); });
  per_job("leasehold_job_interrupted_attempts", "Attempts of the job that were interrupted", false,
          [](const JobSeries& j) { return double(j.interruptions); });
  // Program jobs: what their allocator plug-in reports (PyTorch's own
  // statistics cannot see through it).
  auto per_program = [&](const char* name, const char* help, bool counter, auto value) {
    per_job(name, help, counter,
            [&](const JobSeries& j) { return j.program ? double(value(*j.program)) : NAN; });
  };
  per_program("leasehold_job_program_in_use_bytes",
              "Bytes of a program job's leases handed to its tensors", false,
              [](const ProgramSeries& p) { return p.in_use_bytes; });
  per_program("leasehold_job_program_allocations_total", "Allocations a program job made", true,
              [](const ProgramSeries& p) { return p.allocations; });
  per_program("leasehold_job_program_cache_hits_total",
              "Allocations of a program job served from its plug-in's cache", true,
              [](const ProgramSeries& p) { return p.cache_hits; });
  per_program("leasehold_job_program_lease_requests_total",
              "Lease requests of a program job's plug-in that reached the coordinator", true,
              [](const ProgramSeries& p) { return p.lease_requests; });
  per_program("leasehold_job_program_outside_pool_bytes",
              "A program job's own device memory outside the pool (CUDA context included)", false,
              [](const ProgramSeries& p) { return p.outside_pool_bytes; });
  device_gauge("leasehold_regions", "Shared cache regions resident in the pool",
               [](const DeviceSeries& d) { return double(d.regions_resident); });
  device_gauge("leasehold_region_bytes", "Pool bytes of resident regions",
               [](const DeviceSeries& d) { return double(d.region_bytes); });
  device_counter("leasehold_region_hits_total", "Region attaches that found it ready",
                 [](const DeviceSeries& d) { return double(d.region_hits); });
  device_counter("leasehold_region_misses_total", "Region attaches that had to fill it",
                 [](const DeviceSeries& d) { return double(d.region_misses); });
  device_counter("leasehold_region_evictions_total", "Regions evicted to free memory",
                 [](const DeviceSeries& d) { return double(d.region_evictions); });
  f.counter("leasehold_device_faults_total", "Device faults agents reported",
            double(s.device_faults));
  f.gauge("leasehold_uptime_seconds", "Seconds since the coordinator started", s.uptime_seconds);
  return prometheus::TextSerializer().Serialize(f.families());
}

}  // namespace leasehold
