// CURVE keys for network endpoints. On ipc:// the kernel says who a peer is
// (coordinator/peer.h); on tcp:// nothing does, so there every connection is
// encrypted and authenticated with CurveZMQ (Curve25519 key pairs, written
// as 40-character Z85 text). The coordinator has a key pair and a directory
// of the public keys it lets in; clients and agents have key pairs of their
// own and know the coordinator's public key.
//
// Key files are small TOML files written by `leasehold keygen PATH`:
//   PATH      public-key = "…" and secret-key = "…"   (mode 0600)
//   PATH.pub  public-key = "…"                         (mode 0644)
// A file holding a secret key that other users may read is refused, as ssh
// refuses such a private key.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <zmq.hpp>

namespace leasehold {

struct CurveKeyPair {
  std::string public_key, secret_key;  // Z85, 40 characters each
};

// Environment variables naming a program's own key pair file and the
// coordinator's public key file (flags override them).
inline constexpr const char* kCurveKeyEnv = "LEASEHOLD_CURVE_KEY";
inline constexpr const char* kCurveServerKeyEnv = "LEASEHOLD_CURVE_SERVER_KEY";

// Whether `endpoint` crosses the network (anything but ipc:// and inproc://)
// and so must use CURVE.
bool needs_curve(std::string_view endpoint);

// A fresh key pair from libsodium's generator inside libzmq.
CurveKeyPair generate_curve_key_pair();

// Writes PATH and PATH.pub as above. Never overwrites: an existing file is
// an error naming it. Throws std::runtime_error.
void write_curve_key_pair(const std::string& path, const CurveKeyPair& keys);

// Reads a key pair file. Throws std::runtime_error naming the file when it
// is missing, readable by group or others, malformed, or when its public
// key is not the secret key's.
CurveKeyPair read_curve_key_pair(const std::string& path);

// Reads the public key of a .pub file (or of a key pair file). Throws
// std::runtime_error naming the file.
std::string read_curve_public_key(const std::string& path);

// What a client or an agent needs to reach a coordinator over tcp://.
struct CurveClientKeys {
  std::string server_public;  // the coordinator's public key
  CurveKeyPair own;
};

// The keys for connecting to `endpoint`, from the files named by the flags
// (empty: the environment variables above). nullopt for ipc:// endpoints.
// Throws std::runtime_error when `endpoint` needs CURVE and a file is not
// named, or cannot be read.
std::optional<CurveClientKeys> client_curve_keys(const std::string& endpoint,
                                                 std::string key_file,
                                                 std::string server_key_file);

// Makes `socket` a CURVE client with `keys` (before it connects).
void apply_curve_client(zmq::socket_t& socket, const CurveClientKeys& keys);

}  // namespace leasehold
