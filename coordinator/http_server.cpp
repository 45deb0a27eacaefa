// The HTTP endpoint's server: the acceptor, the connections' counts and
// bounds, the thread's io_context (coordinator/http_server.h).
#include "coordinator/http_server.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <sys/socket.h>
#include <unistd.h>

#include <boost/asio/post.hpp>
#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace leasehold {

HttpEndpoint::Server::Server(HttpEndpoint& endpoint, const std::string& listen)
    : endpoint_(endpoint) {
  const auto [host, port] = parse_http_listen(listen);
  const std::string refused = "cannot serve HTTP on " + listen +
                              " (address in use or not on this machine; set http_listen, or "
                              "\"off\")";
  error_code ec;
  tcp::resolver resolver(ioc_);
  const auto found = resolver.resolve(host, std::to_string(port),
                                      tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec) throw std::runtime_error(refused);
  for (const auto& entry : found) {
    if (try_bind(entry.endpoint())) break;
  }
  if (!acceptor_.is_open()) throw std::runtime_error(refused);
  const auto bound = acceptor_.local_endpoint(ec);
  if (ec) throw std::runtime_error(refused + ": " + ec.message());
  port_ = bound.port();
  loopback_ = bound.address().is_loopback();
  accept();
}

bool HttpEndpoint::Server::try_bind(const tcp::endpoint& at) {
  error_code ec;
  acceptor_.open(at.protocol(), ec);
  if (ec) return false;
  // Not inherited by what the coordinator runs (the MPS daemon outlives it).
  const int fd = acceptor_.native_handle();
  const int flags = ::fcntl(fd, F_GETFD);
  if (flags < 0 || ::fcntl(fd, F_SETFD, flags | FD_CLOEXEC) != 0) ec = net::error::bad_descriptor;
  // SO_REUSEADDR only (a restart binds at once), not SO_REUSEPORT, with
  // which a second coordinator would share the port.
  if (!ec) acceptor_.set_option(tcp::acceptor::reuse_address(true), ec);
  if (!ec) acceptor_.bind(at, ec);
  if (!ec) acceptor_.listen(net::socket_base::max_listen_connections, ec);
  if (!ec) acceptor_.non_blocking(true, ec);  // accept4 below must not block
  if (!ec) return true;
  error_code ignored;  // it was never serving
  acceptor_.close(ignored);
  return false;
}

void HttpEndpoint::Server::run() {
  while (true) {
    try {
      // Accepting again, should a failed handler have been the acceptor's.
      if (!stopping_ && !paused_ && !accept_armed_) accept();
      ioc_.run();
      return;
    } catch (const std::exception& e) {
      // One handler failed (out of memory?): its connection is closed by
      // now, the others are served on.
      spdlog::error("HTTP endpoint: {}", e.what());
    } catch (...) {
      spdlog::error("HTTP endpoint: unknown exception");
    }
  }
}

void HttpEndpoint::Server::stop() {
  net::post(ioc_, [this] { shutdown(); });
}

void HttpEndpoint::Server::shutdown() {
  stopping_ = true;
  error_code ignored;  // closing is all that is left to do
  acceptor_.close(ignored);
  retry_.cancel();
  // Each live connection has a handler pending, which keeps it alive
  // through close(); they end, and run() returns.
  const std::vector<Connection*> all(live_.begin(), live_.end());
  for (Connection* c : all) c->close();
}

void HttpEndpoint::Server::wake() {
  if (wake_posted_.exchange(true)) return;  // one wake-up for many events
  net::post(ioc_, [this] {
    wake_posted_ = false;
    std::vector<std::shared_ptr<Connection>> streams;
    for (Connection* c : streams_) streams.push_back(c->shared_from_this());
    for (auto& c : streams) c->pump();
  });
}

void HttpEndpoint::Server::accept() {
  accept_armed_ = true;
  acceptor_.async_wait(tcp::acceptor::wait_read, [this](error_code ec) {
    accept_armed_ = false;
    on_readable(ec);
  });
}

void HttpEndpoint::Server::retry_accept(const std::string& why) {
  if (!accept_failing_) spdlog::warn("HTTP endpoint cannot accept connections now: {}", why);
  accept_failing_ = true;
  // Out of descriptors or memory: the backlog waits a little rather than
  // the thread spinning.
  retry_.expires_after(std::chrono::milliseconds(100));
  accept_armed_ = true;
  retry_.async_wait([this](error_code ec) {
    accept_armed_ = false;
    if (!ec && !stopping_) accept();
  });
}

void HttpEndpoint::Server::on_readable(error_code ec) {
  if (stopping_ || ec == net::error::operation_aborted) return;
  if (ec) return retry_accept(ec.message());
  sockaddr_storage from{};
  socklen_t from_len = sizeof from;
  // accept4: close-on-exec from the start (the loop's thread may fork).
  const int fd = ::accept4(acceptor_.native_handle(), reinterpret_cast<sockaddr*>(&from), &from_len,
                           SOCK_CLOEXEC);
  if (fd < 0) {
    const int err = errno;
    if (err == EAGAIN || err == EWOULDBLOCK || err == EINTR || err == ECONNABORTED ||
        err == EPROTO) {
      return accept();
    }
    return retry_accept(std::strerror(err));  // EMFILE, ENFILE, ENOBUFS, ENOMEM
  }
  accept_failing_ = false;
  tcp::socket socket(ioc_);
  socket.assign(from.ss_family == AF_INET6 ? tcp::v6() : tcp::v4(), fd, ec);
  if (ec) {
    ::close(fd);
    return accept();
  }
  const auto remote = socket.remote_endpoint(ec);
  if (ec) return accept();  // gone already; the socket closes itself
  error_code ignored;       // Nagle off: only latency, should it fail
  socket.set_option(tcp::no_delay(true), ignored);
  net::ip::address peer = remote.address();
  if (peer.is_v6() && peer.to_v6().is_v4_mapped()) {
    peer = net::ip::make_address_v4(net::ip::v4_mapped, peer.to_v6());
  }
  try {
    auto c = std::make_shared<Connection>(*this, std::move(socket), peer);
    const int from_peer = per_address_[peer];  // this one included
    if (from_peer > kMaxConnectionsPerAddress && refusing_ >= kMaxRefusing) {
      c->close();  // and destroyed below: forgotten
    } else if (from_peer > kMaxConnectionsPerAddress) {
      c->refuse(503, "too many connections from " + peer.to_string() + " (at most " +
                         std::to_string(kMaxConnectionsPerAddress) + " at once)");
    } else {
      c->start();
    }
  } catch (const std::exception& e) {
    // Out of memory: this connection is dropped (its destructor forgot
    // it), the next ones are accepted.
    spdlog::error("HTTP endpoint: a connection from {} dropped: {}", peer.to_string(), e.what());
  }
  if (connections_ < kMaxConnections) {
    accept();
  } else {
    paused_ = true;
  }
}

void HttpEndpoint::Server::admit(Connection* c, const net::ip::address& peer) {
  live_.insert(c);
  try {
    ++per_address_[peer];
  } catch (...) {
    live_.erase(c);
    throw;
  }
  ++connections_;
}

void HttpEndpoint::Server::forget(Connection* c, const net::ip::address& peer) {
  live_.erase(c);
  streams_.erase(c);
  const auto it = per_address_.find(peer);
  if (it != per_address_.end() && --it->second <= 0) per_address_.erase(it);
  --connections_;
  if (paused_ && !stopping_ && connections_ < kMaxConnections) {
    paused_ = false;
    accept();
  }
}

}  // namespace leasehold
