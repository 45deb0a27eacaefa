#include "shared/chunk_channel.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "shared/endpoint.h"

namespace leasehold {
namespace {

// The datagrams, host byte order (both ends are on this host).
constexpr uint32_t kMagic = 0x4b43484c;  // "LHCK"
constexpr uint16_t kVersion = 1;
constexpr size_t kNameMax = 128;

struct RequestWire {
  uint32_t magic;
  uint16_t version;
  uint8_t kind;
  uint8_t agent_len;
  uint64_t session_lo, session_hi;
  uint64_t lease_id;
  uint64_t from_chunk;
  uint8_t region_len;
  char agent[kNameMax];
  char region[kNameMax];
};

struct ReplyWire {
  uint32_t magic;
  uint16_t version;
  uint8_t ok;
  uint8_t access;
  int32_t device;
  uint8_t last;                // the last datagram of this answer
  uint8_t reserved[3];
  uint64_t first, count;       // the grant
  uint64_t batch_first;        // pool index of this datagram's first descriptor
  uint32_t batch_count;
  uint32_t message_len;
  char message[400];
};

std::string errno_text() { return std::strerror(errno); }

sockaddr_un address_of(const std::string& path) {
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path.size() >= sizeof addr.sun_path) {
    throw std::invalid_argument("socket path " + path + " is longer than a Unix socket path may be (" +
                                std::to_string(sizeof addr.sun_path - 1) + " bytes)");
  }
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  return addr;
}

// Sends `reply` with `fds` attached. False when the peer cannot take it now.
bool send_reply(int sock, const ReplyWire& reply, const std::vector<UniqueFd>& fds) {
  iovec iov{const_cast<ReplyWire*>(&reply), sizeof reply};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control;
  if (!fds.empty()) {
    control.resize(CMSG_SPACE(sizeof(int) * fds.size()));
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    int* out = reinterpret_cast<int*>(CMSG_DATA(c));
    for (size_t i = 0; i < fds.size(); ++i) out[i] = fds[i].get();
  }
  return ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT) == static_cast<ssize_t>(sizeof reply);
}

ReplyWire refusal(const std::string& why) {
  ReplyWire r;
  std::memset(&r, 0, sizeof r);  // padding included: nothing of ours goes out by chance
  r.magic = kMagic;
  r.version = kVersion;
  r.ok = 0;
  r.last = 1;
  r.message_len = static_cast<uint32_t>(std::min(why.size(), sizeof r.message));
  std::memcpy(r.message, why.data(), r.message_len);
  return r;
}

}  // namespace

// ---- server ----

ChunkServer::ChunkServer(std::string path, const std::function<void(const std::string&)>& secure,
                         Decide decide)
    : path_(std::move(path)), decide_(std::move(decide)) {
  const sockaddr_un addr = address_of(path_);
  listen_.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (!listen_.valid()) throw std::runtime_error("cannot create the chunk socket: " + errno_text());
  ::unlink(path_.c_str());
  // No permission for anyone else until secure() has set the file's mode.
  const mode_t before = ::umask(0177);
  const int bound = ::bind(listen_.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr);
  const int bind_errno = errno;
  ::umask(before);
  if (bound != 0) {
    throw std::runtime_error("cannot bind the chunk socket " + path_ + ": " +
                             std::strerror(bind_errno));
  }
  if (secure) secure(path_);
  if (::listen(listen_.get(), 128) != 0) {
    throw std::runtime_error("cannot listen on the chunk socket " + path_ + ": " + errno_text());
  }
}

ChunkServer::~ChunkServer() {
  peers_.clear();
  listen_.reset();
  ::unlink(path_.c_str());
}

std::vector<int> ChunkServer::connections() const {
  std::vector<int> out;
  out.reserve(peers_.size());
  for (const Peer& p : peers_) out.push_back(p.fd.get());
  return out;
}

void ChunkServer::accept_pending() {
  while (true) {
    UniqueFd fd(::accept4(listen_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd.valid()) {
      if (errno == EMFILE || errno == ENFILE) {
        // The connection stays queued and the listener readable: not
        // polled again for a while rather than spun on.
        accept_paused_until_ = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
        spdlog::warn("chunk socket: out of descriptors; accepting again in 100 ms");
      } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        spdlog::warn("chunk socket: accept: {}", errno_text());
      }
      return;
    }
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(fd.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      spdlog::warn("chunk socket: no peer credentials: {}", errno_text());
      continue;
    }
    const size_t of_user = static_cast<size_t>(std::count_if(
        peers_.begin(), peers_.end(), [&](const Peer& p) { return p.uid == cred.uid; }));
    if (peers_.size() >= kMaxConnections || of_user >= kMaxConnectionsPerUser) {
      spdlog::warn("chunk socket: refusing a connection from uid {} (pid {}): {} open, {} of its user's",
                   cred.uid, cred.pid, peers_.size(), of_user);
      continue;
    }
    peers_.push_back(Peer{std::move(fd), cred.pid, cred.uid});
  }
}

bool ChunkServer::accepting() const {
  return std::chrono::steady_clock::now() >= accept_paused_until_;
}

void ChunkServer::drop(int fd, const std::string& why) {
  auto it = std::find_if(peers_.begin(), peers_.end(), [&](const Peer& p) { return p.fd.get() == fd; });
  if (it == peers_.end()) return;
  if (!why.empty()) spdlog::warn("chunk socket: dropping pid {}: {}", it->pid, why);
  peers_.erase(it);
}

void ChunkServer::serve(int fd) {
  auto it = std::find_if(peers_.begin(), peers_.end(), [&](const Peer& p) { return p.fd.get() == fd; });
  if (it == peers_.end()) return;
  RequestWire wire{};
  // One more byte than a request: a longer datagram is malformed, not cut.
  char buffer[sizeof(RequestWire) + 1];
  iovec iov{buffer, sizeof buffer};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  // No control buffer: descriptors a client sends are discarded by the
  // kernel, never installed here (closing one could block this loop: a
  // FUSE file's flush waits on its daemon).
  msg.msg_control = nullptr;
  msg.msg_controllen = 0;
  const ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT);
  if (n == 0) return drop(fd, "");
  if (n < 0) {
    if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
    return drop(fd, errno_text());
  }
  if (static_cast<size_t>(n) != sizeof wire || (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
    ++refused_;
    send_reply(fd, refusal("malformed chunk request (" + std::to_string(n) + " bytes)"), {});
    return drop(fd, "malformed request of " + std::to_string(n) + " bytes");
  }
  std::memcpy(&wire, buffer, sizeof wire);
  if (wire.magic != kMagic || wire.version != kVersion ||
      (wire.kind != static_cast<uint8_t>(ChunkRequest::Kind::Lease) &&
       wire.kind != static_cast<uint8_t>(ChunkRequest::Kind::Region)) ||
      wire.agent_len == 0 || wire.agent_len > kNameMax || wire.region_len > kNameMax) {
    ++refused_;
    send_reply(fd, refusal("malformed chunk request (magic, version, kind or name length)"), {});
    return drop(fd, "malformed request");
  }
  ChunkRequest req;
  req.kind = static_cast<ChunkRequest::Kind>(wire.kind);
  req.agent.assign(wire.agent, wire.agent_len);
  req.session = SessionToken{wire.session_lo, wire.session_hi};
  req.lease_id = wire.lease_id;
  req.region.assign(wire.region, wire.region_len);
  req.from_chunk = wire.from_chunk;
  if (!answer(*it, req)) drop(fd, "it does not take its answer");
}

bool ChunkServer::answer(Peer& peer, const ChunkRequest& req) {
  Decision d;
  try {
    d = decide_(req, peer.pid, peer.uid);
  } catch (const std::exception& e) {
    d.refusal = e.what();
  }
  if (!d.grant || !d.pool) {
    ++refused_;
    return send_reply(peer.fd.get(), refusal(d.refusal.empty() ? "refused" : d.refusal), {});
  }
  const ChunkGrant& g = *d.grant;
  const uint64_t end = g.first + g.count;
  if (req.from_chunk > end) {
    ++refused_;
    return send_reply(peer.fd.get(), refusal("chunk " + std::to_string(req.from_chunk) +
                                             " is past the grant's end"), {});
  }
  ReplyWire r;
  std::memset(&r, 0, sizeof r);
  r.magic = kMagic;
  r.version = kVersion;
  r.ok = 1;
  r.access = static_cast<uint8_t>(g.access);
  r.device = g.device;
  r.first = g.first;
  r.count = g.count;
  uint64_t next = std::max(g.first, req.from_chunk);
  // At most kAnswerChunks per answer, so an answer always fits the
  // socket's buffer while the asker maps; it asks again for the rest.
  const uint64_t stop = std::min(end, next + kAnswerChunks);
  try {
    do {
      const uint64_t batch_end = std::min(stop, next + kChunkBatch);
      std::vector<UniqueFd> fds;
      fds.reserve(batch_end - next);
      for (uint64_t i = next; i < batch_end; ++i) fds.push_back(d.pool->share(i, g.access));
      r.batch_first = next;
      r.batch_count = static_cast<uint32_t>(fds.size());
      r.last = batch_end == stop;
      if (!send_reply(peer.fd.get(), r, fds)) return false;
      next = batch_end;
    } while (next < stop);
  } catch (const std::exception& e) {
    // Out of descriptors, most likely: the asker learns why and may ask again.
    ++refused_;
    return send_reply(peer.fd.get(), refusal(e.what()), {});
  }
  ++served_;
  return true;
}

// ---- client ----

void ChunkClient::connect_locked() {
  const sockaddr_un addr = address_of(path_);
  UniqueFd fd(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
  if (!fd.valid()) throw std::runtime_error("cannot create a socket for the chunk channel: " + errno_text());
  if (::connect(fd.get(), reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::runtime_error("cannot connect to the coordinator's chunk socket " + path_ + ": " +
                             errno_text());
  }
  // A coordinator that stops answering must not hang the agent.
  timeval tv{30, 0};
  ::setsockopt(fd.get(), SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd.get(), SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  fd_ = std::move(fd);
}

ChunkGrant ChunkClient::fetch(
    const ChunkRequest& req,
    const std::function<void(uint64_t, std::vector<UniqueFd>, const ChunkGrant&)>& take) {
  if (req.agent.empty() || req.agent.size() > kNameMax || req.region.size() > kNameMax) {
    throw std::invalid_argument("chunk request: agent or region name of the wrong length");
  }
  RequestWire wire;
  std::memset(&wire, 0, sizeof wire);  // padding included
  wire.magic = kMagic;
  wire.version = kVersion;
  wire.kind = static_cast<uint8_t>(req.kind);
  wire.agent_len = static_cast<uint8_t>(req.agent.size());
  wire.session_lo = req.session.lo;
  wire.session_hi = req.session.hi;
  wire.lease_id = req.lease_id;
  wire.from_chunk = req.from_chunk;
  wire.region_len = static_cast<uint8_t>(req.region.size());
  std::memcpy(wire.agent, req.agent.data(), req.agent.size());
  std::memcpy(wire.region, req.region.data(), req.region.size());

  std::lock_guard lock(mu_);
  ChunkGrant grant;
  uint64_t next = req.from_chunk;
  bool first_answer = true;
  while (true) {
    wire.from_chunk = next;
    send_locked(&wire, sizeof wire);
    // One answer: datagrams up to the one marked last.
    bool last = false;
    while (!last) {
      ReplyWire r;
      std::memset(&r, 0, sizeof r);
      iovec iov{&r, sizeof r};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      std::vector<char> control(CMSG_SPACE(sizeof(int) * kChunkBatch));
      msg.msg_control = control.data();
      msg.msg_controllen = control.size();
      ssize_t n;
      do {
        n = ::recvmsg(fd_.get(), &msg, MSG_CMSG_CLOEXEC);
      } while (n < 0 && errno == EINTR);
      std::vector<UniqueFd> fds;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
          const size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
          for (size_t i = 0; i < k; ++i) fds.emplace_back(reinterpret_cast<int*>(CMSG_DATA(c))[i]);
        }
      }
      if (n != static_cast<ssize_t>(sizeof r) || r.magic != kMagic || r.version != kVersion ||
          (msg.msg_flags & MSG_CTRUNC)) {
        const std::string why =
            n < 0 ? errno_text() : n == 0 ? "the coordinator closed it" : "a malformed answer";
        fd_.reset();
        throw std::runtime_error("chunk socket " + path_ + ": " + why);
      }
      if (!r.ok) {
        // A refusal ends its answer; the connection is good for the next.
        throw std::runtime_error(
            std::string(r.message, std::min<size_t>(r.message_len, sizeof r.message)));
      }
      const ChunkGrant g{r.device, r.first, r.count,
                         r.access == static_cast<uint8_t>(Access::ReadOnly) ? Access::ReadOnly
                                                                            : Access::ReadWrite};
      if (first_answer) {
        grant = g;
        next = std::max(next, g.first);
        first_answer = false;
      }
      if (g.first != grant.first || g.count != grant.count || g.access != grant.access ||
          fds.size() != r.batch_count || r.batch_first != next ||
          next + fds.size() > grant.first + grant.count) {
        fd_.reset();
        throw std::runtime_error("chunk socket " + path_ + ": an answer with the wrong descriptors");
      }
      next += fds.size();
      last = r.last;
      if (fds.empty()) continue;
      try {
        take(r.batch_first, std::move(fds), grant);
      } catch (...) {
        fd_.reset();  // the rest of the answer is not read: a new connection next time
        throw;
      }
    }
    if (next >= grant.first + grant.count) return grant;
  }
}

void ChunkClient::send_locked(const void* bytes, size_t size) {
  // A connection the coordinator closed (it restarted, or dropped us)
  // shows on the send: connect again once.
  for (int attempt = 0;; ++attempt) {
    if (!fd_.valid()) connect_locked();
    ssize_t sent;
    do {
      sent = ::send(fd_.get(), bytes, size, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent == static_cast<ssize_t>(size)) return;
    const std::string why = errno_text();
    fd_.reset();
    if (attempt == 1) throw std::runtime_error("cannot send to the chunk socket " + path_ + ": " + why);
  }
}

std::string chunk_socket_path(const std::string& endpoint, const std::string& state_dir) {
  const auto ipc = ipc_path(endpoint);
  std::string path = ipc ? *ipc + ".chunks" : state_dir + "/chunks.sock";
  (void)address_of(path);  // throws when too long
  return path;
}

}  // namespace leasehold
