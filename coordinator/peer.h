// Who sent a message: on ipc:// the kernel's credentials of the peer
// process (SO_PEERCRED, which libzmq reads at connect and attaches to every
// message as its "Peer-Address" property, "localhost:UID:GID:PID"); on
// tcp:// nothing the kernel vouches for, but the name of the CURVE key the
// coordinator's ZAP handler let in (coordinator/zap_handler.h).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>
#include <zmq.hpp>

namespace leasehold {

struct Peer {
  // A local process, as the kernel describes it.
  static Peer local(uint32_t uid, uint32_t gid, int32_t pid) {
    Peer p;
    p.known = true;
    p.uid = uid;
    p.gid = gid;
    p.pid = pid;
    return p;
  }
  // A network peer admitted by the CURVE key of this name.
  static Peer with_key(std::string name, bool client = true, bool agent = false) {
    Peer p;
    p.key = std::move(name);
    p.key_client = client;
    p.key_agent = agent;
    return p;
  }

  bool known = false;  // uid/gid/pid come from the kernel
  uint32_t uid = 0, gid = 0;
  int32_t pid = 0;
  std::string key;                             // CURVE key name ("User-Id"); empty on ipc://
  bool key_client = false, key_agent = false;  // its roles ("X-Roles")
  // On ipc://, the user's name and groups as the ZAP handler looked them up
  // when the peer connected (coordinator/zap_handler.h); empty and nullopt
  // when no handler did.
  std::string user;
  std::optional<std::vector<uint32_t>> groups;
  // "key NAME" for a CURVE peer, "" otherwise: how its jobs are recorded.
  std::string key_user() const { return key.empty() ? std::string() : "key " + key; }
  // Who it is, as an attempt records its agent: "uid N" for a local peer,
  // "key NAME" for a CURVE one, "" when unknown.
  std::string identity() const { return known ? "uid " + std::to_string(uid) : key_user(); }
};

// Parses a "Peer-Address" value; unknown for anything but "HOST:UID:GID:PID".
Peer parse_peer_address(std::string_view address);
// The peer of a received message (unknown when libzmq attached no address).
Peer peer_of(zmq::message_t& message);

}  // namespace leasehold
