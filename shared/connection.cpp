#include "shared/connection.h"

#include <spdlog/spdlog.h>

#include <filesystem>
#include <thread>

#include "shared/endpoint.h"

namespace leasehold {

const Reply& Reply::throw_if_error() const {
  if (env_->body_type() == proto::Body::Error) {
    const auto* e = env_->body_as_Error();
    throw Error(e->code(), std::string(str(e->message())));
  }
  return *this;
}

Connection::Connection(zmq::context_t& ctx, std::string endpoint, std::string sender)
    : socket_(ctx, zmq::socket_type::dealer), endpoint_(std::move(endpoint)),
      sender_(std::move(sender)) {
  socket_.set(zmq::sockopt::linger, 0);
  // Do not queue requests for a coordinator that is not there: fail fast
  // instead of delivering stale requests when it comes back.
  socket_.set(zmq::sockopt::immediate, 1);
  socket_.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(kMaxMessageBytes));
  socket_.connect(endpoint_);
}

std::optional<Reply> Connection::receive(std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    // Round the wait up, and once the deadline has passed poll one last time
    // without waiting: truncating to whole milliseconds would spin for up
    // to a millisecond at the end (and a zero timeout would always spin).
    auto now = std::chrono::steady_clock::now();
    bool last = now >= deadline;
    auto wait = last ? std::chrono::milliseconds(0)
                     : std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
    zmq::pollitem_t item{socket_.handle(), 0, ZMQ_POLLIN, 0};
    zmq::poll(&item, 1, wait);
    zmq::message_t msg;
    if (!(item.revents & ZMQ_POLLIN) || !socket_.recv(msg, zmq::recv_flags::dontwait)) {
      if (last) return std::nullopt;
      continue;
    }
    AlignedBytes bytes(msg);
    auto decoded = decode(bytes.bytes());
    if (auto* err = std::get_if<DecodeError>(&decoded)) {
      spdlog::warn("dropping a malformed message from {}: {}", endpoint_, err->message);
      continue;
    }
    const proto::Envelope* env = std::get<const proto::Envelope*>(decoded);
    return Reply(std::move(bytes), env);
  }
}

Reply Connection::request(const BodyBuilder& build, std::chrono::milliseconds timeout) {
  flatbuffers::FlatBufferBuilder fbb(512);
  uint64_t id = next_request_id();
  auto [type, body] = build(fbb);
  finish_envelope(fbb, header(id), type, body);
  // The coordinator's socket drops a larger message with the connection,
  // silently: the sender would only see its timeout.
  if (fbb.GetSize() > kMaxMessageBytes) {
    throw Error(ErrorCode::InvalidArgument,
                std::string(proto::EnumNameBody(type)) + " message of " +
                    std::to_string(fbb.GetSize()) + " bytes exceeds the protocol's limit of " +
                    std::to_string(kMaxMessageBytes) + " bytes; nothing was sent");
  }
  auto deadline = std::chrono::steady_clock::now() + timeout;
  // With ZMQ_IMMEDIATE a send fails with EAGAIN while no connection is up;
  // retry until the deadline so a coordinator that is starting gets a chance.
  while (!socket_.send(to_message(fbb), zmq::send_flags::dontwait)) {
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error(ErrorCode::Timeout, unreachable_message(endpoint_, timeout));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  while (true) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    auto reply = receive(std::max(left, std::chrono::milliseconds(0)));
    if (!reply) throw Error(ErrorCode::Timeout, unreachable_message(endpoint_, timeout));
    uint64_t rid = (*reply)->header()->request_id();
    if (rid == id) return std::move(*reply);
    if (rid == 0) {
      if (on_notice) on_notice(*reply);
    } else if (on_late_reply) {
      on_late_reply(*reply);
    } else {
      spdlog::debug("skipping a late reply to request {} (waiting for {})", rid, id);
    }
  }
}

std::string unreachable_message(const std::string& endpoint, std::chrono::milliseconds waited) {
  std::string msg = "no reply from the coordinator at " + endpoint + " within " +
                    std::to_string(waited.count()) + " ms";
  if (auto path = ipc_path(endpoint); path && !std::filesystem::exists(*path)) {
    msg += " (socket " + *path + " does not exist: is leasehold-coordinator running?)";
  }
  return msg;
}

}  // namespace leasehold
