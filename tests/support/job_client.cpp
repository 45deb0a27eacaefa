#include "tests/support/job_client.h"

#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "shared/endpoint.h"
#include "shared/job_spec.h"
#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold::testing {

JobClient::JobClient(const std::string& endpoint)
    : conn_(ctx_, endpoint, "bench-client"), events_(ctx_, zmq::socket_type::sub) {
  events_.set(zmq::sockopt::linger, 0);
  events_.set(zmq::sockopt::subscribe, "job.");
  events_.connect(default_events_endpoint(endpoint));
}

uint64_t JobClient::submit(const proto::JobSpecT& spec) {
  Reply r = conn_.request(
      [&](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::SubmitJob,
                         proto::CreateSubmitJob(fbb, proto::JobSpec::Pack(fbb, &spec)).Union()};
      },
      std::chrono::seconds(30));
  r.throw_if_error();
  return r->body_as_JobAccepted()->job_id();
}

std::map<uint64_t, JobEnd> JobClient::wait_ends(const std::vector<uint64_t>& ids,
                                                std::chrono::seconds timeout) {
  std::set<uint64_t> left(ids.begin(), ids.end());
  std::map<uint64_t, JobEnd> ends;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!left.empty()) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error(std::to_string(left.size()) + " job(s) did not end within " +
                               std::to_string(timeout.count()) + " s");
    }
    zmq::pollitem_t item{events_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, std::chrono::milliseconds(100));
    if (!(item.revents & ZMQ_POLLIN)) continue;
    zmq::message_t topic, body;
    if (!events_.recv(topic) || !topic.more() || !events_.recv(body)) continue;
    const uint64_t now = unix_time_us();
    AlignedBytes bytes(body);
    auto decoded = decode(bytes.bytes());
    auto* env = std::get_if<const proto::Envelope*>(&decoded);
    if (!env || (*env)->body_type() != proto::Body::JobInfo) continue;
    const auto* job = (*env)->body_as_JobInfo();
    const std::string state(job_state_text(*job));
    if (!left.count(job->id()) || state == "queued" || state == "running") continue;
    JobEnd e;
    e.id = job->id();
    e.state = state;
    e.reason = str(job->reason());
    e.assigned_at_us = job->assigned_at_us();
    e.first_step_at_us = job->first_step_at_us();
    e.event_at_us = now;
    e.samples_per_second = job->samples_per_second();
    e.test_accuracy = job->test_accuracy();
    ends[e.id] = e;
    left.erase(e.id);
  }
  return ends;
}

void JobClient::drop_dataset_regions() {
  Reply r = conn_.request(
      [](flatbuffers::FlatBufferBuilder& fbb) {
        return std::pair{proto::Body::ListRegions, proto::CreateListRegions(fbb).Union()};
      },
      std::chrono::seconds(5));
  r.throw_if_error();
  std::vector<std::string> names;
  for (const auto* region : *r->body_as_RegionList()->regions()) {
    std::string name(str(region->name()));
    if (name.rfind("dataset/", 0) == 0 && region->state() == proto::RegionState::Ready) {
      names.push_back(name);
    }
  }
  for (const auto& name : names) {
    conn_
        .request(
            [&](flatbuffers::FlatBufferBuilder& fbb) {
              return std::pair{proto::Body::DropRegion,
                               proto::CreateDropRegion(fbb, fbb.CreateString(name)).Union()};
            },
            std::chrono::seconds(5))
        .throw_if_error();
  }
}

std::unique_ptr<proto::JobSpecT> read_job_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  auto buffer = parse_job_json(text.str(), path);
  return std::unique_ptr<proto::JobSpecT>(verify_job(buffer)->UnPack());
}

}  // namespace leasehold::testing
