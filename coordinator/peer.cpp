#include "coordinator/peer.h"

#include <charconv>

namespace leasehold {
namespace {

template <class T>
bool number(std::string_view text, T& out) {
  if (text.empty()) return false;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), out);
  return ec == std::errc{} && end == text.data() + text.size();
}

}  // namespace

Peer parse_peer_address(std::string_view address) {
  // The last three ':'-separated fields (an IPv6 host has colons of its own,
  // but tcp addresses carry no credentials at all).
  Peer p;
  const auto c3 = address.rfind(':');
  if (c3 == std::string_view::npos || c3 == 0) return p;
  const auto c2 = address.rfind(':', c3 - 1);
  if (c2 == std::string_view::npos || c2 == 0) return p;
  const auto c1 = address.rfind(':', c2 - 1);
  if (c1 == std::string_view::npos) return p;
  if (address.substr(0, c1) != "localhost") return p;  // what libzmq writes for ipc
  if (number(address.substr(c1 + 1, c2 - c1 - 1), p.uid) &&
      number(address.substr(c2 + 1, c3 - c2 - 1), p.gid) &&
      number(address.substr(c3 + 1), p.pid)) {
    p.known = true;
  }
  return p;
}

Peer peer_of(zmq::message_t& message) {
  // zmq_msg_gets, not cppzmq's gets(): that throws for a missing property.
  const char* address = zmq_msg_gets(message.handle(), "Peer-Address");
  Peer peer = address ? parse_peer_address(address) : Peer{};
  // Set only when a ZAP handler accepted the connection with a user id.
  if (const char* user = zmq_msg_gets(message.handle(), "User-Id"); user && !peer.known) {
    peer.key = user;
  }
  return peer;
}

}  // namespace leasehold
