#include "coordinator/http_views.h"

#include <flatbuffers/flatbuffers.h>

#include <nlohmann/json.hpp>

#include "client/job_format.h"
#include "client/status_format.h"
#include "coordinator/job_codec.h"

namespace leasehold {
namespace {

// Packs an object-API value and hands its table to a renderer that reads
// tables (the client renders what it received off the wire).
template <class Table, class Object, class Render>
auto via_table(const Object& object, Render render) {
  flatbuffers::FlatBufferBuilder fbb(1024);
  fbb.Finish(Table::Pack(fbb, &object));
  return render(*flatbuffers::GetRoot<Table>(fbb.GetBufferPointer()));
}

// Invalid UTF-8 in a name or a reason becomes U+FFFD instead of an
// exception in the loop.
std::string dump(const nlohmann::json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace

std::string render_status_json(const proto::StatusReplyT& status) {
  return via_table<proto::StatusReply>(
      status, [](const proto::StatusReply& s) { return dump(status_to_json(s)); });
}

JobViews job_views(const JobRecord& job) {
  return JobViews{job.id, job_info(job, kSummaryDetail), job_info(job, kFullDetail)};
}

std::string render_job_json(const proto::JobInfoT& info) {
  return dump(
      via_table<proto::JobInfo>(info, [](const proto::JobInfo& j) { return job_to_json(j); }));
}

std::string render_job_event(const JobRecord& job) {
  // As the PUB socket's events: progress, not the whole record.
  return dump(
      {{"topic", "job." + std::to_string(job.id) + "."},
       {"job", via_table<proto::JobInfo>(*job_info(job, kEventDetail),
                                         [](const proto::JobInfo& j) { return job_to_json(j); })}});
}

std::string render_notice_event(const Notice& notice) {
  nlohmann::json out{{"topic", notice.topic}};
  if (const auto* s = notice.body.AsShrink()) {
    out["shrink"] = {{"id", s->id},
                     {"agent", s->agent},
                     {"job_id", s->job_id},
                     {"bytes", s->bytes},
                     {"deadline_ms", s->deadline_ms},
                     {"reason", s->reason}};
  } else if (const auto* d = notice.body.AsShrinkDone()) {
    out["shrink_done"] = {
        {"id", d->id}, {"released", d->released}, {"leased", d->leased}, {"reason", d->reason}};
  } else {
    out["type"] = proto::EnumNameBody(notice.body.type);
  }
  return dump(out);
}

}  // namespace leasehold
