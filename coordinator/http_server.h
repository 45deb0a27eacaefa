// The HTTP endpoint's server (private to coordinator/http_endpoint*.cpp):
// one Asio io_context on the endpoint's thread, its acceptor and the limits'
// counts (HttpEndpoint::Server, http_server.cpp), one client connection
// (HttpEndpoint::Connection, http_connection.cpp), and the request head as
// Beast parses it. The limits themselves are HttpEndpoint's constants.
#pragma once

#include <array>
#include <atomic>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/http/basic_parser.hpp>
#include <boost/beast/http/error.hpp>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>

#include "coordinator/http_endpoint.h"
#include "coordinator/http_request.h"

namespace leasehold {

namespace http_detail {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

// The request line and the few fields the endpoint looks at; the others are
// counted and dropped. Beast hands fields over only once the whole head is
// in the read buffer, which kMaxHeaderBytes bounds, and is asked for the
// head alone: the body callbacks are never reached.
class RequestHead final : public bhttp::basic_parser<true> {
 public:
  RequestHead() {
    header_limit(static_cast<std::uint32_t>(HttpEndpoint::kMaxHeaderBytes));
    // Never read, so never too long (Beast would call a long one malformed;
    // not boost::none, which Boost 1.74 compares as smaller than any size).
    body_limit(std::numeric_limits<std::uint64_t>::max());
  }

  bhttp::verb method = bhttp::verb::unknown;
  std::string method_name;
  std::string target;
  int version = 11;
  int hosts = 0;     // Host fields seen
  std::string host;  // the last one's value
  bool transfer_encoding = false;
  bool too_many_fields = false;

 private:
  void on_request_impl(bhttp::verb m, beast::string_view name, beast::string_view t, int v,
                       error_code&) override {
    method = m;
    method_name.assign(name.data(), name.size());
    target.assign(t.data(), t.size());
    version = v;
  }
  void on_response_impl(int, beast::string_view, int, error_code& ec) override {
    ec = bhttp::error::bad_method;  // a request parser: never called
  }
  void on_field_impl(bhttp::field f, beast::string_view, beast::string_view value,
                     error_code& ec) override {
    if (++fields_ > HttpEndpoint::kMaxHeaderFields) {
      too_many_fields = true;
      ec = bhttp::error::header_limit;
      return;
    }
    if (f == bhttp::field::host) {
      ++hosts;
      host.assign(value.data(), value.size());
    } else if (f == bhttp::field::transfer_encoding) {
      transfer_encoding = true;
    }
  }
  void on_header_impl(error_code&) override {}
  void on_body_init_impl(const boost::optional<std::uint64_t>&, error_code& ec) override {
    ec = bhttp::error::unexpected_body;
  }
  size_t on_body_impl(beast::string_view, error_code& ec) override {
    ec = bhttp::error::unexpected_body;
    return 0;
  }
  void on_chunk_header_impl(std::uint64_t, beast::string_view, error_code& ec) override {
    ec = bhttp::error::unexpected_body;
  }
  size_t on_chunk_body_impl(std::uint64_t, beast::string_view, error_code& ec) override {
    ec = bhttp::error::unexpected_body;
    return 0;
  }
  void on_finish_impl(error_code&) override {}

  int fields_ = 0;
};

}  // namespace http_detail

using namespace http_detail;  // NOLINT: the two classes below are the endpoint's own

// The server: one io_context on the endpoint's thread; everything below runs
// on that thread except stop() and wake().

class HttpEndpoint::Server {
 public:
  Server(HttpEndpoint& endpoint, const std::string& listen);
  void run();   // the endpoint's thread: serves until stop()
  void stop();  // any thread: closes everything; run() then returns
  void wake();  // any thread: streams send what is new

  int port() const { return port_; }
  bool loopback() const { return loopback_; }
  HttpEndpoint& endpoint() { return endpoint_; }
  net::io_context& context() { return ioc_; }
  std::set<Connection*>& streams() { return streams_; }
  int& refusing() { return refusing_; }
  // A connection counts (from its constructor: all or nothing) and is gone
  // (from its destructor).
  void admit(Connection* c, const net::ip::address& peer);
  void forget(Connection* c, const net::ip::address& peer);

 private:
  bool try_bind(const tcp::endpoint& at);
  void accept();
  void on_readable(error_code ec);
  void retry_accept(const std::string& why);
  void shutdown();

  HttpEndpoint& endpoint_;
  // Declared before the io_context: a connection destroyed with it still
  // finds them.
  std::map<net::ip::address, int> per_address_;
  std::set<Connection*> live_;
  std::set<Connection*> streams_;
  int connections_ = 0;
  int refusing_ = 0;     // connections being answered 503 unread
  bool paused_ = false;  // at kMaxConnections: the backlog waits
  bool stopping_ = false;
  bool accept_armed_ = false;    // a wait for the next connection is pending
  bool accept_failing_ = false;  // logged once until an accept succeeds
  std::atomic<bool> wake_posted_{false};
  net::io_context ioc_{1};
  tcp::acceptor acceptor_{ioc_};
  net::steady_timer retry_{ioc_};
  int port_ = 0;
  bool loopback_ = false;
};

class HttpEndpoint::Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(Server& server, tcp::socket socket, net::ip::address peer)
      : server_(server),
        endpoint_(server.endpoint()),
        socket_(std::move(socket)),
        peer_(std::move(peer)),
        deadline_(server.context()),
        keepalive_(server.context()) {
    server_.admit(this, peer_);
  }
  ~Connection() {
    if (attached_) endpoint_.events_.detach();
    if (refusing_) --server_.refusing();
    server_.forget(this, peer_);
  }

  void start() { read_request(); }
  // Answers at once without reading the request, then closes; counted in
  // the server's refusing() until destroyed.
  void refuse(int status, const std::string& message) {
    refusing_ = true;
    ++server_.refusing();
    send(reply_text(error_reply(status, message), false, false), false);
  }
  // A stream: sends the events it has not sent yet, or a keep-alive comment.
  void pump();
  // Closes at once, whatever it was doing; pending handlers then end.
  void close();

 private:
  enum class Phase { kReading, kWriting, kStreaming, kLingering, kClosed };

  void read_request();
  void on_head(error_code ec);
  void answer();
  void send(std::string bytes, bool keep_alive);
  void send_error(int status, const std::string& message, bool keep_alive) {
    const bool head_only = head_ && head_->method == bhttp::verb::head;
    send(reply_text(error_reply(status, message), keep_alive, head_only), keep_alive);
  }
  void open_stream(bool keep_alive);
  void write_stream(std::string bytes);
  void watch_stream();
  void linger();
  void drain();
  void arm(std::chrono::steady_clock::duration d);
  void disarm();
  void on_deadline();

  Server& server_;
  HttpEndpoint& endpoint_;
  tcp::socket socket_;
  const net::ip::address peer_;
  net::steady_timer deadline_;                  // the request's, a write's, or the linger's
  net::steady_timer keepalive_;                 // a stream's next ": idle"
  uint64_t deadline_generation_ = 0;            // a fired timer of an older deadline is ignored
  beast::flat_buffer buffer_{kMaxHeaderBytes};  // never larger
  std::optional<RequestHead> head_;
  Phase phase_ = Phase::kReading;
  bool timed_out_ = false;
  bool refusing_ = false;  // answered 503 unread
  std::string out_;        // what is being written
  size_t drained_ = 0;
  // An event stream:
  bool attached_ = false;  // holds a place in endpoint_.events_
  bool chunked_ = true;
  bool writing_ = false;
  bool idle_due_ = false;
  uint64_t cursor_ = 0;
  std::array<char, 256> stray_{};  // what a stream's client sends (it should not)
};

}  // namespace leasehold
