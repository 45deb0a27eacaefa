#include "shared/curve_keys.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <stdexcept>
#include <toml++/toml.h>

namespace leasehold {
namespace {

constexpr size_t kZ85KeyLength = 40;
// A key file is two short lines; anything much larger is not one.
constexpr off_t kMaxKeyFileBytes = 4096;

std::string errno_text(int err) { return std::strerror(err); }

// The text of a small regular file, opened without blocking (a FIFO named
// by mistake must not hang the program). `secret`: refuse a file that
// group or others may read.
std::string read_key_file(const std::string& path, bool secret) {
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) throw std::runtime_error("cannot open key file " + path + ": " + errno_text(errno));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    throw std::runtime_error("cannot stat key file " + path + ": " + errno_text(errno));
  }
  if (!S_ISREG(st.st_mode)) throw std::runtime_error("key file " + path + " is not a regular file");
  if (st.st_size > kMaxKeyFileBytes) {
    throw std::runtime_error("key file " + path + " is " + std::to_string(st.st_size) +
                             " bytes: not a key file (at most " +
                             std::to_string(kMaxKeyFileBytes) + ")");
  }
  if (secret && (st.st_mode & 077) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
    throw std::runtime_error("key file " + path + " holds a secret key but has mode " + mode +
                             ": other users could read it (chmod 600 " + path + ")");
  }
  std::string text(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < text.size()) {
    ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw std::runtime_error("cannot read key file " + path + ": " + errno_text(errno));
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  return text;
}

// A Z85 key of 40 characters that decodes to 32 bytes.
bool valid_z85_key(const std::string& key) {
  if (key.size() != kZ85KeyLength) return false;
  uint8_t raw[32];
  return zmq_z85_decode(raw, key.c_str()) != nullptr;
}

std::string key_field(const toml::table& doc, const std::string& field, const std::string& path) {
  auto value = doc[field].value<std::string>();
  if (!value) throw std::runtime_error("key file " + path + " has no " + field);
  if (!valid_z85_key(*value)) {
    throw std::runtime_error("key file " + path + ": " + field +
                             " is not a 40-character Z85 key");
  }
  return *value;
}

toml::table parse_key_file(const std::string& text, const std::string& path) {
  try {
    return toml::parse(text, path);
  } catch (const toml::parse_error& e) {
    throw std::runtime_error("key file " + path + ": " + std::string(e.description()) +
                             " at line " + std::to_string(e.source().begin.line));
  }
}

void write_new_file(const std::string& path, const std::string& text, mode_t mode) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, mode);
  if (fd < 0) {
    throw std::runtime_error("cannot create " + path + ": " + errno_text(errno) +
                             (errno == EEXIST ? " (keygen never overwrites a key)" : ""));
  }
  // The umask must not widen or narrow what the mode says.
  bool ok = ::fchmod(fd, mode) == 0;
  size_t done = 0;
  while (ok && done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    ok = n > 0;
    if (ok) done += static_cast<size_t>(n);
  }
  ok = ok && ::fsync(fd) == 0;
  int err = errno;
  ::close(fd);
  if (!ok) {
    ::unlink(path.c_str());
    throw std::runtime_error("cannot write " + path + ": " + errno_text(err));
  }
}

}  // namespace

bool needs_curve(std::string_view endpoint) {
  return !endpoint.empty() && endpoint.rfind("ipc://", 0) != 0 && endpoint.rfind("inproc://", 0) != 0;
}

CurveKeyPair generate_curve_key_pair() {
  char pub[kZ85KeyLength + 1], sec[kZ85KeyLength + 1];
  if (zmq_curve_keypair(pub, sec) != 0) {
    throw std::runtime_error(std::string("cannot make a CURVE key pair: ") +
                             zmq_strerror(zmq_errno()) +
                             " (libzmq built without CURVE support?)");
  }
  return {pub, sec};
}

void write_curve_key_pair(const std::string& path, const CurveKeyPair& keys) {
  // Both names are checked before either is written, so a failure leaves
  // no half pair behind.
  for (const std::string& p : {path, path + ".pub"}) {
    if (::access(p.c_str(), F_OK) == 0) {
      throw std::runtime_error(p + " exists; keygen never overwrites a key");
    }
  }
  // Its folder (~/.config/leasehold, as the docs suggest) is made when
  // missing, private to its owner: it holds a secret.
  if (const auto dir = std::filesystem::path(path).parent_path(); !dir.empty()) {
    std::error_code ec;
    if (std::filesystem::create_directories(dir, ec)) {
      std::filesystem::permissions(dir, std::filesystem::perms::owner_all, ec);
    } else if (ec) {
      throw std::runtime_error("cannot create " + dir.string() + " for the key pair: " +
                               ec.message());
    }
  }
  const std::string pub = "# Leasehold CURVE public key: give this file to the other side\n"
                          "public-key = \"" + keys.public_key + "\"\n";
  write_new_file(path + ".pub", pub, 0644);
  try {
    write_new_file(path, "# Leasehold CURVE key pair: SECRET, keep it mode 0600\n"
                         "public-key = \"" + keys.public_key + "\"\n"
                         "secret-key = \"" + keys.secret_key + "\"\n",
                   0600);
  } catch (...) {
    ::unlink((path + ".pub").c_str());
    throw;
  }
}

CurveKeyPair read_curve_key_pair(const std::string& path) {
  const toml::table doc = parse_key_file(read_key_file(path, true), path);
  CurveKeyPair keys{key_field(doc, "public-key", path), key_field(doc, "secret-key", path)};
  char derived[kZ85KeyLength + 1];
  if (zmq_curve_public(derived, keys.secret_key.c_str()) != 0 || keys.public_key != derived) {
    throw std::runtime_error("key file " + path +
                             ": its public-key does not belong to its secret-key");
  }
  return keys;
}

std::string read_curve_public_key(const std::string& path) {
  return key_field(parse_key_file(read_key_file(path, false), path), "public-key", path);
}

std::optional<CurveClientKeys> client_curve_keys(const std::string& endpoint,
                                                 std::string key_file,
                                                 std::string server_key_file) {
  if (!needs_curve(endpoint)) return std::nullopt;
  if (key_file.empty()) {
    if (const char* e = std::getenv(kCurveKeyEnv)) key_file = e;
  }
  if (server_key_file.empty()) {
    if (const char* e = std::getenv(kCurveServerKeyEnv)) server_key_file = e;
  }
  if (key_file.empty() || server_key_file.empty()) {
    throw std::runtime_error(
        endpoint + " is a network endpoint, which Leasehold only uses with CURVE: name this "
        "program's key pair (--curve-key or $" + std::string(kCurveKeyEnv) +
        ", made by `leasehold keygen`) and the coordinator's public key (--curve-server-key or $" +
        kCurveServerKeyEnv + ")");
  }
  return CurveClientKeys{read_curve_public_key(server_key_file), read_curve_key_pair(key_file)};
}

void apply_curve_client(zmq::socket_t& socket, const CurveClientKeys& keys) {
  socket.set(zmq::sockopt::curve_serverkey, keys.server_public);
  socket.set(zmq::sockopt::curve_publickey, keys.own.public_key);
  socket.set(zmq::sockopt::curve_secretkey, keys.own.secret_key);
}

}  // namespace leasehold
