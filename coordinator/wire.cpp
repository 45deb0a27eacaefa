#include "coordinator/wire.h"

#include <spdlog/spdlog.h>

#include "coordinator/job_codec.h"
#include "shared/protocol.h"
#include "shared/units.h"

namespace leasehold {

zmq::message_t encode_message(const OutMessage& m) {
  flatbuffers::FlatBufferBuilder fbb(512);
  auto body = m.body.Pack(fbb);
  finish_envelope(fbb, {m.request_id, "coordinator", {}}, m.body.type, body);
  if (fbb.GetSize() <= kMaxMessageBytes) return to_message(fbb);
  std::string why = std::string("the reply (") + proto::EnumNameBody(m.body.type) + ", " +
                    format_bytes(fbb.GetSize()) + ") exceeds the protocol's limit of " +
                    format_bytes(kMaxMessageBytes);
  spdlog::error("{}", why);
  return make_error({m.request_id, "coordinator", {}}, ErrorCode::Internal, why);
}

std::string event_topic(uint64_t job_id) { return "job." + std::to_string(job_id) + "."; }

zmq::message_t encode_event(const JobRecord& job) {
  flatbuffers::FlatBufferBuilder fbb(1024);
  auto info = job_info(job, kEventDetail);
  auto body = proto::JobInfo::Pack(fbb, info.get());
  finish_envelope(fbb, {0, "coordinator", {}}, proto::Body::JobInfo, body.Union());
  return to_message(fbb);
}

zmq::message_t encode_notice(const Notice& notice) {
  flatbuffers::FlatBufferBuilder fbb(256);
  auto body = notice.body.Pack(fbb);
  finish_envelope(fbb, {0, "coordinator", {}}, notice.body.type, body);
  return to_message(fbb);
}

}  // namespace leasehold
