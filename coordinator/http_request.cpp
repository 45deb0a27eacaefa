#include "coordinator/http_request.h"

#include <arpa/inet.h>

#include <boost/beast/http/status.hpp>
#include <stdexcept>

namespace leasehold::http_detail {
namespace {

namespace bhttp = boost::beast::http;

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// %XX decoded (and '+' as a space in a query); nullopt on a bad escape.
std::optional<std::string> percent_decode(std::string_view s, bool plus_is_space) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%') {
      if (i + 2 >= s.size()) return std::nullopt;
      const int hi = hex_digit(s[i + 1]), lo = hex_digit(s[i + 2]);
      if (hi < 0 || lo < 0) return std::nullopt;
      out += static_cast<char>(hi * 16 + lo);
      i += 2;
    } else if (s[i] == '+' && plus_is_space) {
      out += ' ';
    } else {
      out += s[i];
    }
  }
  return out;
}

bool valid_port(std::string_view p) {
  return !p.empty() && p.size() <= 5 &&
         p.find_first_not_of("0123456789") == std::string_view::npos &&
         std::stoul(std::string(p)) <= 65535;
}

}  // namespace

std::string shown(std::string_view text) {
  constexpr size_t kShown = 120;
  std::string out(text.substr(0, kShown));
  if (text.size() > kShown) out += "...";
  return out;
}

std::string json_text(const nlohmann::json& j) {
  // Invalid UTF-8 from a client becomes U+FFFD instead of an exception.
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Reply error_reply(int status, const std::string& message) {
  return {status, "application/json", json_text({{"error", message}}), false};
}

std::string head_text(int status, std::string_view content_type, std::optional<size_t> length,
                      bool keep_alive, bool no_cache, bool chunked) {
  const auto reason = bhttp::obsolete_reason(bhttp::int_to_status(static_cast<unsigned>(status)));
  std::string out = "HTTP/1.1 " + std::to_string(status) + " ";
  out.append(reason.data(), reason.size());
  out += "\r\nContent-Type: ";
  out += content_type;
  out += "\r\n";
  if (length) out += "Content-Length: " + std::to_string(*length) + "\r\n";
  if (chunked) out += "Transfer-Encoding: chunked\r\n";
  if (no_cache) out += "Cache-Control: no-cache\r\n";
  out += keep_alive ? "Connection: keep-alive\r\n\r\n" : "Connection: close\r\n\r\n";
  return out;
}

std::string reply_text(const Reply& r, bool keep_alive, bool head_only) {
  std::string out =
      head_text(r.status, r.content_type, r.body.size(), keep_alive, r.no_cache, false);
  if (!head_only) out += r.body;
  return out;
}

std::optional<Request> parse_target(std::string_view target, bool head) {
  if (target.empty() || target.front() != '/') return std::nullopt;
  Request req;
  req.head = head;
  const auto q = target.find('?');
  auto path = percent_decode(target.substr(0, q), false);
  if (!path) return std::nullopt;
  req.path = std::move(*path);
  if (q == std::string_view::npos) return req;
  std::string_view query = target.substr(q + 1);
  while (!query.empty()) {
    const auto amp = query.find('&');
    const std::string_view pair = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (pair.empty()) continue;
    const auto eq = pair.find('=');
    auto name = percent_decode(pair.substr(0, eq), true);
    auto value = percent_decode(eq == std::string_view::npos ? "" : pair.substr(eq + 1), true);
    if (!name || !value) return std::nullopt;
    req.params.emplace(std::move(*name), std::move(*value));  // the first one stays
  }
  return req;
}

uint64_t number_param(const Request& req, const char* name, uint64_t fallback) {
  const auto it = req.params.find(name);
  if (it == req.params.end()) return fallback;
  const std::string& text = it->second;
  if (text.empty() || text.find_first_not_of("0123456789") != std::string::npos ||
      text.size() > 19) {
    throw std::invalid_argument(std::string("query parameter '") + name +
                                "' must be a whole number, not '" + shown(text) + "'");
  }
  return std::stoull(text);
}

std::optional<HostName> parse_host(std::string_view value) {
  HostName h;
  std::string_view rest;
  if (!value.empty() && value.front() == '[') {
    const auto close = value.find(']');
    if (close == std::string_view::npos) return std::nullopt;
    h.kind = HostName::Kind::kIpv6;
    h.name = std::string(value.substr(1, close - 1));
    if (::inet_pton(AF_INET6, h.name.c_str(), &h.v6) != 1) return std::nullopt;  // no zone ids
    rest = value.substr(close + 1);
  } else {
    const auto colon = value.find(':');
    h.name = std::string(value.substr(0, colon));
    if (colon != std::string_view::npos) rest = value.substr(colon);
    if (h.name.empty() || h.name.size() > 253) return std::nullopt;
    for (char& c : h.name) {
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      const bool ok =
          (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' || c == '.' || c == '_';
      if (!ok) return std::nullopt;
    }
    if (h.name.find_first_not_of("0123456789.") == std::string::npos) {
      // Digits and dots: an IPv4 address in dotted-decimal form, or nothing.
      if (::inet_pton(AF_INET, h.name.c_str(), &h.v4) != 1) return std::nullopt;
      h.kind = HostName::Kind::kIpv4;
    }
  }
  if (!rest.empty() && (rest.front() != ':' || !valid_port(rest.substr(1)))) return std::nullopt;
  return h;
}

bool is_loopback_host(const HostName& h) {
  switch (h.kind) {
    case HostName::Kind::kName:
      return h.name == "localhost";
    case HostName::Kind::kIpv4:
      return (ntohl(h.v4.s_addr) >> 24) == 127;
    case HostName::Kind::kIpv6:
      return IN6_IS_ADDR_LOOPBACK(&h.v6);
  }
  return false;
}

}  // namespace leasehold::http_detail
