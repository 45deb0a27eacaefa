#include "coordinator/metrics.h"

#include <prometheus/metric_family.h>
#include <prometheus/text_serializer.h>

#include <cmath>
#include <limits>

#include "coordinator/core.h"
#include "shared/printable.h"

namespace leasehold {
namespace {

// States that always have a series (at 0 when empty), so a panel or an
// alert on one does not see it vanish.
constexpr const char* kAgentStates[] = {"idle", "leasing", "running", "warming", "restarting"};

// Builds families whose every series carries gpu and UUID.
class Families {
 public:
  Families(const std::string& gpu, const std::string& uuid)
      : common_{{"gpu", gpu}, {"UUID", uuid}} {}

  void gauge(const char* name, const char* help, double value,
             std::vector<prometheus::ClientMetric::Label> labels = {}) {
    family(name, help, prometheus::MetricType::Gauge).metric.push_back(point(labels));
    out_.back().metric.back().gauge.value = value;
  }
  void counter(const char* name, const char* help, double value,
               std::vector<prometheus::ClientMetric::Label> labels = {}) {
    family(name, help, prometheus::MetricType::Counter).metric.push_back(point(labels));
    out_.back().metric.back().counter.value = value;
  }
  void histogram(const char* name, const char* help, const LeaseStats& s) {
    auto& m = family(name, help, prometheus::MetricType::Histogram).metric;
    m.push_back(point({}));
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
  prometheus::ClientMetric point(std::vector<prometheus::ClientMetric::Label> labels) const {
    prometheus::ClientMetric m;
    m.label = common_;
    m.label.insert(m.label.end(), labels.begin(), labels.end());
    // Prometheus refuses a whole scrape over one label value that is not
    // UTF-8 (a job name is the submitter's bytes).
    for (auto& l : m.label) l.value = printable(l.value);
    return m;
  }

  std::vector<prometheus::ClientMetric::Label> common_;
  std::vector<prometheus::MetricFamily> out_;
};

}  // namespace

MetricsSnapshot take_metrics_snapshot(const CoordinatorCore& core,
                                      const proto::StatusReplyT& status, std::string gpu,
                                      std::string uuid) {
  MetricsSnapshot s;
  s.gpu = std::move(gpu);
  s.uuid = std::move(uuid);
  if (status.pool) {
    if (status.pool->info) s.pool_bytes = status.pool->info->size;
    s.used_bytes = status.pool->used_bytes;
    s.free_bytes = status.pool->free_bytes;
    s.largest_free_bytes = status.pool->largest_free_bytes;
    s.free_blocks = status.pool->free_blocks;
  }
  s.occupancy = status.occupancy ? status.occupancy->occupancy
                : s.pool_bytes   ? double(s.used_bytes) / double(s.pool_bytes)
                                 : 0;
  s.requests_waiting = status.pending_requests;
  s.uptime_seconds = double(status.uptime_ms) / 1000;

  for (const char* state : kAgentStates) s.agents_by_state[state] = 0;
  // A job's memory: its agent's leases, and a program job's also those of
  // its program's own session (an entry of its own, carrying the job's id).
  std::map<uint64_t, uint64_t> leased_by_job;
  for (const auto& a : status.agents) {
    ++s.agents_by_state[a->state];
    if (a->job_id) leased_by_job[a->job_id] += a->leased_bytes;
  }
  for (const auto& [name, region] : core.regions().all()) {
    if (region.lease_id == 0) continue;
    ++s.regions_resident;
    ++s.region_leases;
    s.region_bytes += region.lease_bytes;
  }
  s.leases_held = status.leases.size() - std::min<uint64_t>(status.leases.size(), s.region_leases);
  s.region_hits = core.regions().hits;
  s.region_misses = core.regions().misses;
  s.region_evictions = core.regions().evictions;

  for (JobState state : {JobState::Queued, JobState::Running, JobState::Succeeded,
                         JobState::Failed, JobState::Cancelled}) {
    s.jobs_by_state[job_state_name(state)] = core.jobs().count(state);
  }
  for (uint64_t id : core.jobs().running()) {
    const JobRecord& job = *core.jobs().find(id);
    JobSeries j;
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
  s.lease_stats = core.lease_stats();
  for (Interruption i : kInterruptions) {
    auto it = core.interruptions().find(i);
    s.interruptions[std::string(interruption_name(i))] =
        it == core.interruptions().end() ? 0 : it->second;
  }
  s.device_faults = core.device_faults();
  return s;
}

std::string render_metrics(const MetricsSnapshot& s) {
  Families f(s.gpu, s.uuid);
  f.gauge("leasehold_pool_size_bytes", "Size of the pool", double(s.pool_bytes));
  f.gauge("leasehold_pool_used_bytes", "Bytes of the pool leased (agents and regions)",
          double(s.used_bytes));
  f.gauge("leasehold_pool_free_bytes", "Bytes of the pool not leased", double(s.free_bytes));
  f.gauge("leasehold_pool_largest_free_block_bytes", "Largest free block of the pool",
          double(s.largest_free_bytes));
  f.gauge("leasehold_pool_free_blocks", "Free blocks of the pool (fragmentation)",
          double(s.free_blocks));
  f.gauge("leasehold_pool_occupancy_ratio", "Leased bytes / pool size", s.occupancy);
  f.gauge("leasehold_leases", "Leases by state", double(s.leases_held), {{"state", "held"}});
  f.gauge("leasehold_leases", "Leases by state", double(s.region_leases), {{"state", "region"}});
  f.gauge("leasehold_leases", "Leases by state", double(s.requests_waiting),
          {{"state", "waiting"}});
  for (const auto& [state, n] : s.agents_by_state) {
    f.gauge("leasehold_agents", "Agents by state", double(n), {{"state", state}});
  }
  const LeaseStats& l = s.lease_stats;
  f.counter("leasehold_lease_grants_total", "Lease requests granted", double(l.grants));
  f.counter("leasehold_lease_refusals_total", "Lease requests refused at once",
            double(l.refusals));
  f.counter("leasehold_lease_timeouts_total",
            "Lease requests refused after waiting until their deadline", double(l.timeouts));
  f.histogram("leasehold_lease_grant_latency_seconds",
              "Time a granted lease request waited for memory", l);
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
      std::vector<prometheus::ClientMetric::Label> labels{
          {"job_id", std::to_string(j.id)}, {"name", j.name}, {"agent", j.agent},
          {"user", j.user}};
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
              "A program job's own device memory outside the pool (CUDA context included)",
              false, [](const ProgramSeries& p) { return p.outside_pool_bytes; });
  f.gauge("leasehold_regions", "Shared cache regions resident in the pool",
          double(s.regions_resident));
  f.gauge("leasehold_region_bytes", "Pool bytes of resident regions", double(s.region_bytes));
  f.counter("leasehold_region_hits_total", "Region attaches that found it ready",
            double(s.region_hits));
  f.counter("leasehold_region_misses_total", "Region attaches that had to fill it",
            double(s.region_misses));
  f.counter("leasehold_region_evictions_total", "Regions evicted to free memory",
            double(s.region_evictions));
  f.counter("leasehold_device_faults_total", "Device faults agents reported",
            double(s.device_faults));
  f.gauge("leasehold_uptime_seconds", "Seconds since the coordinator started", s.uptime_seconds);
  return prometheus::TextSerializer().Serialize(f.families());
}

}  // namespace leasehold
