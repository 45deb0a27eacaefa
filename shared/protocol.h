// The wire codec: building Envelopes and checking received buffers. Every
// received buffer goes through decode() before any field is read.
#pragma once

#include <flatbuffers/flatbuffers.h>

#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <optional>
#include <string_view>
#include <variant>
#include <vector>
#include <zmq.hpp>

#include "schemas/leasehold_generated.h"
#include "shared/error.h"
#include "shared/session_token.h"

namespace leasehold {

// Bumped whenever schemas/leasehold.fbs changes incompatibly.
inline constexpr uint16_t kProtocolVersion = 7;
// Largest message anyone may send. Status replies for thousands of leases fit
// well inside; anything bigger is refused before verification.
inline constexpr size_t kMaxMessageBytes = 4u << 20;

struct HeaderFields {
  uint64_t request_id = 0;
  std::string_view sender;
  SessionToken session;
};

// Finishes `fbb` as an Envelope holding `body` of type `type`.
void finish_envelope(flatbuffers::FlatBufferBuilder& fbb, const HeaderFields& header,
                     proto::Body type, flatbuffers::Offset<void> body);

// Copies the finished buffer of `fbb` into a ZeroMQ message.
zmq::message_t to_message(const flatbuffers::FlatBufferBuilder& fbb);

// A complete Error envelope.
zmq::message_t make_error(const HeaderFields& header, ErrorCode code, std::string_view message);

// A received message's bytes, 8-byte aligned as FlatBuffers' accessors
// require. ZeroMQ keeps small messages inline at arbitrary alignment, so
// every received buffer is copied here before decode().
class AlignedBytes {
 public:
  AlignedBytes() = default;
  explicit AlignedBytes(const zmq::message_t& msg)
      : words_((msg.size() + 7) / 8), size_(msg.size()) {
    if (size_) std::memcpy(words_.data(), msg.data(), size_);
  }
  std::span<const uint8_t> bytes() const {
    return {reinterpret_cast<const uint8_t*>(words_.data()), size_};
  }

 private:
  std::vector<uint64_t> words_;
  size_t size_ = 0;
};

// Why a buffer was rejected; `message` names what was wrong.
struct DecodeError {
  ErrorCode code;
  std::string message;
};

// Checks size, file identifier, FlatBuffers verification, presence of header
// and body, and the protocol version. On success returns the envelope, which
// points into `data` (keep `data` alive). REQUIRES: `data` is 8-byte aligned
// (use AlignedBytes for received messages).
std::variant<const proto::Envelope*, DecodeError> decode(std::span<const uint8_t> data);

// An agent's state as status, the metrics and JSON name it: "idle",
// "leasing", "running", "warming", "restarting", "program".
std::string agent_state_name(proto::AgentState state);

// A job status's name in JSON, tables and logs: "queued", "running",
// "succeeded", "failed", "cancelled", "interrupted" ("" for Unset); and back.
std::string job_status_name(proto::JobStatus status);
std::optional<proto::JobStatus> parse_job_status(std::string_view name);

// Convenience: flatbuffers string or "" when absent.
inline std::string_view str(const flatbuffers::String* s) {
  return s ? std::string_view(s->data(), s->size()) : std::string_view();
}

// A job's (or a history entry's) state as text: its status, or the text
// of one stored before protocol version 6.
std::string job_state_text(const proto::JobInfo& job);
std::string job_state_text(const proto::StateChange& change);

}  // namespace leasehold
