// One client connection of the HTTP endpoint: its request read within the
// deadline, its answer, or its event stream (coordinator/http_server.h).
#include <spdlog/spdlog.h>

#include <boost/asio/post.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/http/read.hpp>

#include "coordinator/http_server.h"

namespace leasehold {
namespace {

std::string seconds_text(std::chrono::seconds s) { return std::to_string(s.count()) + " s"; }

}  // namespace

void HttpEndpoint::Connection::arm(std::chrono::steady_clock::duration d) {
  deadline_.expires_after(d);  // cancels the wait for the previous one
  deadline_.async_wait([self = shared_from_this(), gen = ++deadline_generation_](error_code ec) {
    if (ec || gen != self->deadline_generation_ || self->phase_ == Phase::kClosed) return;
    self->on_deadline();
  });
}

void HttpEndpoint::Connection::disarm() {
  ++deadline_generation_;
  deadline_.cancel();
}

void HttpEndpoint::Connection::on_deadline() {
  if (phase_ == Phase::kReading && !timed_out_) {
    // The read ends with operation_aborted, and on_head answers 408. Should
    // the read be between two reads of its own just now, the deadline is
    // armed again: it then closes.
    timed_out_ = true;
    error_code ignored;  // nothing pending to cancel is not an error here
    socket_.cancel(ignored);
    arm(std::chrono::seconds(1));
    return;
  }
  close();  // a write or a drain that took too long
}

void HttpEndpoint::Connection::close() {
  if (phase_ == Phase::kClosed) return;
  phase_ = Phase::kClosed;
  disarm();
  keepalive_.cancel();
  error_code ignored;  // a peer that reset the connection first: closed all the same
  socket_.shutdown(tcp::socket::shutdown_both, ignored);
  socket_.close(ignored);
  if (attached_) {
    endpoint_.events_.detach();
    attached_ = false;
    server_.streams().erase(this);
  }
}

void HttpEndpoint::Connection::read_request() {
  phase_ = Phase::kReading;
  timed_out_ = false;
  head_.emplace();
  arm(kRequestDeadline);
  bhttp::async_read_header(
      socket_, buffer_, *head_,
      [self = shared_from_this()](error_code ec, size_t) { self->on_head(ec); });
}

void HttpEndpoint::Connection::on_head(error_code ec) {
  if (phase_ == Phase::kClosed) return;
  if (!ec) return answer();
  if (timed_out_ && ec == net::error::operation_aborted) {
    // Nothing of a next request on a kept-alive connection: just close it.
    if (buffer_.size() == 0 && !head_->got_some()) return close();
    return send_error(408, "request not received whole within " + seconds_text(kRequestDeadline),
                      false);
  }
  if (ec == bhttp::error::header_limit || ec == bhttp::error::buffer_overflow) {
    return send_error(
        431,
        head_->too_many_fields
            ? "more than " + std::to_string(kMaxHeaderFields) + " request header lines"
            : "request headers over " + std::to_string(kMaxHeaderBytes / 1024) + " KiB",
        false);
  }
  if (ec.category() == bhttp::make_error_code(bhttp::error::bad_method).category() &&
      ec != bhttp::error::end_of_stream && ec != bhttp::error::partial_message) {
    return send_error(400, "malformed request: " + ec.message(), false);
  }
  close();  // the client went away (end of stream, reset)
}

void HttpEndpoint::Connection::answer() {
  disarm();
  const RequestHead& h = *head_;
  const auto length = h.content_length();
  const bool get = h.method == bhttp::verb::get || h.method == bhttp::verb::head;
  const std::string method = shown(h.method_name);
  // The body is never read: the connection closes after the answer.
  if (h.transfer_encoding || h.chunked() || (length && *length > 0)) {
    if (!get && !h.transfer_encoding && length && *length <= kMaxBody) {
      return send_error(405, method + " is not served: the HTTP endpoint is read-only", false);
    }
    return send_error(413, "request bodies are not accepted: this endpoint is read-only", false);
  }
  if (h.hosts == 0) return send_error(400, "no Host header", false);
  if (h.hosts > 1) return send_error(400, "more than one Host header", false);
  const auto host = parse_host(h.host);
  if (!host) {
    return send_error(
        400, "Host '" + shown(h.host) + "' is not a host name or address with an optional port",
        false);
  }
  const bool keep_alive = h.keep_alive();
  // Bound to loopback, only requests that name a loopback host are served:
  // a web page elsewhere cannot read the API through DNS rebinding.
  if (server_.loopback() && !is_loopback_host(*host)) {
    return send_error(403, "Host '" + shown(h.host) + "' is not this loopback endpoint",
                      keep_alive);
  }
  if (!get) {
    return send_error(405, method + " is not served: the HTTP endpoint is read-only", keep_alive);
  }
  auto req = parse_target(h.target, h.method == bhttp::verb::head);
  if (!req) {
    return send_error(400, "request target '" + shown(h.target) + "' is not a path", false);
  }
  if (req->path == "/api/events" && !req->head) return open_stream(keep_alive);
  if (req->path == "/api/events") {
    return send(head_text(200, "text/event-stream", std::nullopt, false, true, false), false);
  }
  send(reply_text(endpoint_.serve(*req), keep_alive, req->head), keep_alive);
}

void HttpEndpoint::Connection::send(std::string bytes, bool keep_alive) {
  phase_ = Phase::kWriting;
  out_ = std::move(bytes);
  arm(kWriteDeadline);
  net::async_write(socket_, net::buffer(out_),
                   [self = shared_from_this(), keep_alive](error_code ec, size_t) {
                     if (self->phase_ == Phase::kClosed) return;
                     self->disarm();
                     std::string().swap(self->out_);  // an idle connection keeps no answer
                     if (ec) return self->close();
                     if (keep_alive) return self->read_request();
                     self->linger();
                   });
}

void HttpEndpoint::Connection::linger() {
  phase_ = Phase::kLingering;
  error_code ignored;  // a peer already gone: the drain below ends at once
  socket_.shutdown(tcp::socket::shutdown_send, ignored);
  buffer_.consume(buffer_.size());
  drained_ = 0;
  arm(kLinger);
  drain();
}

void HttpEndpoint::Connection::drain() {
  // Into the read buffer and forgotten: what a client still sends costs no
  // memory.
  socket_.async_read_some(buffer_.prepare(buffer_.max_size()),
                          [self = shared_from_this()](error_code ec, size_t n) {
                            if (self->phase_ == Phase::kClosed) return;
                            self->drained_ += n;
                            if (ec || self->drained_ >= kLingerBytes) return self->close();
                            self->drain();
                          });
}

void HttpEndpoint::Connection::open_stream(bool keep_alive) {
  if (!endpoint_.events_.attach(kMaxStreams)) {
    return send_error(503,
                      "too many event streams open (at most " + std::to_string(kMaxStreams) + ")",
                      keep_alive);
  }
  attached_ = true;
  server_.streams().insert(this);
  phase_ = Phase::kStreaming;
  chunked_ = head_->version >= 11;  // HTTP/1.0: the stream ends with the connection
  cursor_ = endpoint_.events_.end();
  std::string first = head_text(200, "text/event-stream", std::nullopt, false, true, chunked_);
  head_.reset();
  buffer_.consume(buffer_.size());
  // A comment first, so the browser sees the stream open at once.
  const std::string hello = ": leasehold events\n\n";
  if (chunked_) {
    char size[16];
    std::snprintf(size, sizeof size, "%zx\r\n", hello.size());
    first += size + hello + "\r\n";
  } else {
    first += hello;
  }
  write_stream(std::move(first));
  watch_stream();
}

void HttpEndpoint::Connection::write_stream(std::string bytes) {
  writing_ = true;
  out_ = std::move(bytes);
  arm(kWriteDeadline);  // a client that stops reading gives its place back
  net::async_write(socket_, net::buffer(out_), [self = shared_from_this()](error_code ec, size_t) {
    if (self->phase_ == Phase::kClosed) return;
    self->disarm();
    self->writing_ = false;
    std::string().swap(self->out_);
    if (ec) return self->close();
    self->idle_due_ = false;
    self->keepalive_.expires_after(kKeepAlive);
    self->keepalive_.async_wait([self](error_code kec) {
      if (kec || self->phase_ == Phase::kClosed) return;
      self->idle_due_ = true;
      self->pump();
    });
    self->pump();  // events that came while writing
  });
}

void HttpEndpoint::Connection::watch_stream() {
  // A stream's client sends nothing: its end (or anything it sends) ends
  // the stream, and its place is free at once.
  socket_.async_read_some(net::buffer(stray_),
                          [self = shared_from_this()](error_code, size_t) { self->close(); });
}

void HttpEndpoint::Connection::pump() {
  if (phase_ != Phase::kStreaming || writing_) return;
  const auto batch = endpoint_.events_.take(cursor_);
  std::string text;
  if (batch.missed) {
    text += "event: missed\ndata: {\"missed\":" + std::to_string(batch.missed) + "}\n\n";
  }
  for (const auto& e : batch.events) {
    text += "data: ";
    text += *e;
    text += "\n\n";
  }
  if (text.empty()) {
    if (!idle_due_) return;
    text = ": idle\n\n";  // keeps proxies from closing an idle stream
  }
  if (chunked_) {
    char size[24];
    std::snprintf(size, sizeof size, "%zx\r\n", text.size());
    text = size + text + "\r\n";
  }
  write_stream(std::move(text));
}

}  // namespace leasehold
