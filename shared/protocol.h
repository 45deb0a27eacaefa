// The wire codec: building Envelopes and checking received buffers. Every
// received buffer goes through decode() before any field is read.
#pragma once

#include <flatbuffers/flatbuffers.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>

#include <zmq.hpp>

#include "schemas/leasehold_generated.h"
#include "shared/error.h"

namespace leasehold {

// Bumped whenever schemas/leasehold.fbs changes incompatibly.
inline constexpr uint16_t kProtocolVersion = 1;
// Largest message anyone may send. Status replies for thousands of leases fit
// well inside; anything bigger is refused before verification.
inline constexpr size_t kMaxMessageBytes = 4u << 20;

struct HeaderFields {
  uint64_t request_id = 0;
  std::string_view sender;
  uint64_t session = 0;
};

// Finishes `fbb` as an Envelope holding `body` of type `type`.
void finish_envelope(flatbuffers::FlatBufferBuilder& fbb, const HeaderFields& header,
                     proto::Body type, flatbuffers::Offset<void> body);

// Copies the finished buffer of `fbb` into a ZeroMQ message.
zmq::message_t to_message(const flatbuffers::FlatBufferBuilder& fbb);

// A complete Error envelope.
zmq::message_t make_error(const HeaderFields& header, ErrorCode code, std::string_view message);

// Why a buffer was rejected; `message` names what was wrong.
struct DecodeError {
  ErrorCode code;
  std::string message;
};

// Checks size, file identifier, FlatBuffers verification, presence of header
// and body, and the protocol version. On success returns the envelope, which
// points into `data` (keep `data` alive).
std::variant<const proto::Envelope*, DecodeError> decode(std::span<const uint8_t> data);

// Convenience: flatbuffers string or "" when absent.
inline std::string_view str(const flatbuffers::String* s) {
  return s ? std::string_view(s->data(), s->size()) : std::string_view();
}

}  // namespace leasehold
