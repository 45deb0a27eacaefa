// The broker's side of the HTTP endpoint (coordinator/http_endpoint.h): what
// the loop hands its threads, a few times a second and as jobs change.
#include "coordinator/broker.h"
#include "coordinator/http_endpoint.h"
#include "coordinator/http_views.h"
#include "coordinator/metrics.h"

namespace leasehold {

std::string Broker::http_address() const {
  const std::string host = parse_http_listen(opts_.http_listen).first;
  const bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(http_->port());
}

void Broker::publish_http() {
  const auto status = core_->status(now());
  http_->publish_status(render_status_json(status), take_metrics_snapshot(*core_, status));
  std::vector<JobViews> changed;
  std::vector<uint64_t> removed;
  for (uint64_t id : http_jobs_changed_) {
    if (const JobRecord* job = core_->jobs().find(id)) {
      changed.push_back(job_views(*job));
    } else {
      removed.push_back(id);
    }
  }
  http_jobs_changed_.clear();
  if (!changed.empty() || !removed.empty()) http_->publish_jobs(std::move(changed), removed);
  http_published_ = Clock::now();
}

void Broker::note_for_http(const Effects& effects) {
  http_jobs_changed_.insert(effects.events.begin(), effects.events.end());
  http_jobs_changed_.insert(effects.store_puts.begin(), effects.store_puts.end());
  http_jobs_changed_.insert(effects.store_deletes.begin(), effects.store_deletes.end());
  if (!http_->streaming()) return;
  // The browser sees a change as it happens (not only once it is stored,
  // as subscribers of the PUB socket do): the page only shows it.
  for (uint64_t id : effects.events) {
    if (const JobRecord* job = core_->jobs().find(id)) http_->publish_event(render_job_event(*job));
  }
  for (const auto& n : effects.notices) http_->publish_event(render_notice_event(n));
}

}  // namespace leasehold
