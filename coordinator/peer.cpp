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
      number(address.substr(c2 + 1, c3 - c2 - 1), p.gid) && number(address.substr(c3 + 1), p.pid)) {
    p.known = true;
  }
  return p;
}

Peer peer_of(zmq::message_t& message) {
  // zmq_msg_gets, not cppzmq's gets(): that throws for a missing property.
  const char* address = zmq_msg_gets(message.handle(), "Peer-Address");
  Peer peer = address ? parse_peer_address(address) : Peer{};
  if (peer.known) {
    // The ZAP handler's lookup at connect time (coordinator/zap_handler.h).
    if (const char* user = zmq_msg_gets(message.handle(), "X-User")) peer.user = user;
    if (const char* groups = zmq_msg_gets(message.handle(), "X-Groups")) {
      std::vector<uint32_t> gids;
      std::string_view rest(groups);
      bool ok = true;
      while (ok && !rest.empty()) {
        const auto comma = rest.find(',');
        uint32_t gid = 0;
        ok = number(rest.substr(0, comma), gid);
        gids.push_back(gid);
        rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
      }
      if (ok) peer.groups = std::move(gids);
    }
  } else if (const char* user = zmq_msg_gets(message.handle(), "User-Id")) {
    // Set only when the ZAP handler accepted a CURVE key (its name).
    peer.key = user;
    if (const char* roles = zmq_msg_gets(message.handle(), "X-Roles")) {
      const std::string_view r(roles);
      peer.key_client = r == "client" || r == "client,agent";
      peer.key_agent = r == "agent" || r == "client,agent";
    }
  }
  return peer;
}

}  // namespace leasehold
