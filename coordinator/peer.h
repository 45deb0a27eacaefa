// Who sent a message: on ipc:// the kernel's credentials of the peer
// process (SO_PEERCRED, which libzmq reads at connect and attaches to every
// message as its "Peer-Address" property, "localhost:UID:GID:PID"); on
// tcp:// nothing the kernel vouches for.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <zmq.hpp>

namespace leasehold {

struct Peer {
  bool known = false;  // uid/gid/pid come from the kernel
  uint32_t uid = 0, gid = 0;
  int32_t pid = 0;
};

// Parses a "Peer-Address" value; unknown for anything but "HOST:UID:GID:PID".
Peer parse_peer_address(std::string_view address);
// The peer of a received message (unknown when libzmq attached no address).
Peer peer_of(zmq::message_t& message);

}  // namespace leasehold
