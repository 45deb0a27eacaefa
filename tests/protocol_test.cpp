#include "shared/protocol.h"

#include "shared/connection.h"

#include <gtest/gtest.h>

#include <chrono>
#include <random>
#include <vector>

namespace leasehold {
namespace {

std::vector<uint8_t> valid_status_request(uint16_t version = kProtocolVersion) {
  flatbuffers::FlatBufferBuilder fbb;
  finish_envelope(fbb, {42, "test", 0}, proto::Body::StatusRequest,
                  proto::CreateStatusRequest(fbb).Union());
  std::vector<uint8_t> out(fbb.GetBufferPointer(), fbb.GetBufferPointer() + fbb.GetSize());
  if (version != kProtocolVersion) {
    // Rebuild with another version by hand.
    flatbuffers::FlatBufferBuilder b;
    auto sender = b.CreateString("test");
    auto hdr = proto::CreateHeader(b, version, 42, sender, 0);
    auto env = proto::CreateEnvelope(b, hdr, proto::Body::StatusRequest,
                                     proto::CreateStatusRequest(b).Union());
    proto::FinishEnvelopeBuffer(b, env);
    out.assign(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
  }
  return out;
}

DecodeError expect_error(const std::vector<uint8_t>& bytes) {
  auto r = decode(bytes);
  EXPECT_TRUE(std::holds_alternative<DecodeError>(r));
  return std::holds_alternative<DecodeError>(r) ? std::get<DecodeError>(r) : DecodeError{};
}

TEST(Protocol, RoundTrip) {
  auto bytes = valid_status_request();
  auto r = decode(bytes);
  ASSERT_TRUE(std::holds_alternative<const proto::Envelope*>(r));
  auto* env = std::get<const proto::Envelope*>(r);
  EXPECT_EQ(env->header()->request_id(), 42u);
  EXPECT_EQ(str(env->header()->sender()), "test");
  EXPECT_EQ(env->body_type(), proto::Body::StatusRequest);
}

TEST(Protocol, RejectsEmptyAndShortBuffers) {
  EXPECT_NE(expect_error({}).message.find("too short"), std::string::npos);
  EXPECT_EQ(expect_error({1, 2, 3}).code, ErrorCode::Malformed);
}

TEST(Protocol, RejectsWrongIdentifier) {
  auto bytes = valid_status_request();
  bytes[4] = 'X';
  auto e = expect_error(bytes);
  EXPECT_EQ(e.code, ErrorCode::Malformed);
  EXPECT_NE(e.message.find("file identifier"), std::string::npos) << e.message;
}

TEST(Protocol, RejectsEveryTruncation) {
  auto bytes = valid_status_request();
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
    auto r = decode(cut);
    EXPECT_TRUE(std::holds_alternative<DecodeError>(r)) << "truncated to " << n << " bytes";
  }
}

TEST(Protocol, RejectsOversized) {
  std::vector<uint8_t> big(kMaxMessageBytes + 1, 0);
  auto e = expect_error(big);
  EXPECT_NE(e.message.find("exceeds"), std::string::npos);
}

TEST(Protocol, RejectsWrongVersion) {
  auto e = expect_error(valid_status_request(kProtocolVersion + 1));
  EXPECT_EQ(e.code, ErrorCode::BadVersion);
  EXPECT_NE(e.message.find("version"), std::string::npos);
}

TEST(Protocol, RejectsMissingBody) {
  flatbuffers::FlatBufferBuilder b;
  auto sender = b.CreateString("x");
  auto hdr = proto::CreateHeader(b, kProtocolVersion, 1, sender, 0);
  proto::FinishEnvelopeBuffer(b, proto::CreateEnvelope(b, hdr));
  std::vector<uint8_t> bytes(b.GetBufferPointer(), b.GetBufferPointer() + b.GetSize());
  EXPECT_NE(expect_error(bytes).message.find("no body"), std::string::npos);
}

TEST(Protocol, SurvivesRandomGarbageAndBitFlips) {
  std::mt19937 rng(1234);
  for (int i = 0; i < 2000; ++i) {
    std::vector<uint8_t> junk(rng() % 200);
    for (auto& b : junk) b = static_cast<uint8_t>(rng());
    if (junk.size() >= 8 && i % 2) std::copy_n("LHP1", 4, junk.begin() + 4);
    (void)decode(junk);  // must not crash (ASan/UBSan builds check this)
  }
  auto valid = valid_status_request();
  for (size_t i = 0; i < valid.size() * 8; ++i) {
    auto flipped = valid;
    flipped[i / 8] ^= static_cast<uint8_t>(1u << (i % 8));
    (void)decode(flipped);
  }
}

TEST(Protocol, ErrorReplyCarriesCodeAndMessage) {
  auto msg = make_error({9, "coordinator", {}}, ErrorCode::NotOwner, "lease 3 belongs to 'b'");
  AlignedBytes bytes(msg);
  auto r = decode(bytes.bytes());
  auto* env = std::get<const proto::Envelope*>(r);
  ASSERT_EQ(env->body_type(), proto::Body::Error);
  EXPECT_EQ(env->body_as_Error()->code(), ErrorCode::NotOwner);
  EXPECT_EQ(str(env->body_as_Error()->message()), "lease 3 belongs to 'b'");
  EXPECT_EQ(env->header()->request_id(), 9u);
}

}  // namespace
}  // namespace leasehold

namespace leasehold {
namespace {

// A request over the size limit is refused before it is sent, naming the
// limit (the coordinator's socket would drop it with the connection, and the
// sender would only have seen "no reply").
TEST(Protocol, AnOversizedRequestIsRefusedBeforeSending) {
  zmq::context_t ctx(1);
  Connection c(ctx, "ipc:///tmp/leasehold-nobody-listens.sock", "big");
  const auto t0 = std::chrono::steady_clock::now();
  try {
    c.request(
        [](flatbuffers::FlatBufferBuilder& fbb) {
          std::string name(kMaxMessageBytes, 'x');
          return std::pair{proto::Body::Register,
                           proto::CreateRegister(fbb, fbb.CreateString(name), 1).Union()};
        },
        std::chrono::seconds(5));
    ADD_FAILURE() << "sent";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::InvalidArgument);
    EXPECT_NE(std::string(e.what()).find("exceeds the protocol's limit of 4194304 bytes"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(4)) << "not a timeout";
}

}  // namespace
}  // namespace leasehold
