#include "shared/protocol.h"

#include <cctype>
#include <cstring>

namespace leasehold {

void finish_envelope(flatbuffers::FlatBufferBuilder& fbb, const HeaderFields& header,
                     proto::Body type, flatbuffers::Offset<void> body) {
  auto sender = fbb.CreateString(header.sender.data(), header.sender.size());
  auto hdr = proto::CreateHeader(fbb, kProtocolVersion, header.request_id, sender,
                                 header.session.lo, header.session.hi);
  auto env = proto::CreateEnvelope(fbb, hdr, type, body);
  proto::FinishEnvelopeBuffer(fbb, env);
}

zmq::message_t to_message(const flatbuffers::FlatBufferBuilder& fbb) {
  return zmq::message_t(fbb.GetBufferPointer(), fbb.GetSize());
}

zmq::message_t make_error(const HeaderFields& header, ErrorCode code, std::string_view message) {
  flatbuffers::FlatBufferBuilder fbb(256 + message.size());
  auto msg = fbb.CreateString(message.data(), message.size());
  auto body = proto::CreateError(fbb, code, msg);
  finish_envelope(fbb, header, proto::Body::Error, body.Union());
  return to_message(fbb);
}

std::variant<const proto::Envelope*, DecodeError> decode(std::span<const uint8_t> data) {
  if (data.size() > kMaxMessageBytes) {
    return DecodeError{ErrorCode::Malformed, "message of " + std::to_string(data.size()) +
                                                 " bytes exceeds the limit of " +
                                                 std::to_string(kMaxMessageBytes) + " bytes"};
  }
  // Root offset (4 bytes) + file identifier (4 bytes) at least.
  if (data.size() < 8) {
    return DecodeError{ErrorCode::Malformed, "message of " + std::to_string(data.size()) +
                                                 " bytes is too short to be a Leasehold envelope"};
  }
  if (!proto::EnvelopeBufferHasIdentifier(data.data())) {
    std::string got;
    for (int i = 4; i < 8; ++i) {
      char c = static_cast<char>(data[i]);
      got += (c >= 32 && c < 127) ? c : '?';
    }
    return DecodeError{ErrorCode::Malformed, "wrong file identifier '" + got + "' (expected '" +
                                                 proto::EnvelopeIdentifier() + "')"};
  }
  flatbuffers::Verifier verifier(data.data(), data.size());
  if (!proto::VerifyEnvelopeBuffer(verifier)) {
    return DecodeError{ErrorCode::Malformed, "message failed FlatBuffers verification"};
  }
  const proto::Envelope* env = proto::GetEnvelope(data.data());
  if (!env->header()) return DecodeError{ErrorCode::Malformed, "message has no header"};
  if (env->header()->version() != kProtocolVersion) {
    return DecodeError{ErrorCode::BadVersion, "protocol version " +
                                                  std::to_string(env->header()->version()) +
                                                  " is not supported (this side speaks version " +
                                                  std::to_string(kProtocolVersion) + ")"};
  }
  if (env->body_type() == proto::Body::NONE || !env->body()) {
    return DecodeError{ErrorCode::Malformed, "message has no body"};
  }
  return env;
}

std::string agent_state_name(proto::AgentState state) {
  std::string name = proto::EnumNameAgentState(state);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name.empty() ? "unknown" : name;
}

std::string job_status_name(proto::JobStatus status) {
  if (status == proto::JobStatus::Unset) return "";
  std::string name = proto::EnumNameJobStatus(status);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name.empty() ? "unknown" : name;
}

std::optional<proto::JobStatus> parse_job_status(std::string_view name) {
  for (auto s : proto::EnumValuesJobStatus()) {
    if (s != proto::JobStatus::Unset && job_status_name(s) == name) return s;
  }
  return std::nullopt;
}

std::string job_state_text(const proto::JobInfo& job) {
  return job.status() != proto::JobStatus::Unset ? job_status_name(job.status())
                                                 : std::string(str(job.state()));
}

std::string job_state_text(const proto::StateChange& change) {
  return change.status() != proto::JobStatus::Unset ? job_status_name(change.status())
                                                    : std::string(str(change.state()));
}

}  // namespace leasehold
