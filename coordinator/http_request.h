// What the HTTP endpoint (coordinator/http_endpoint.h) reads of a request
// and writes back: the target and its query, the Host header as the Host
// rule parses it, and answers as the bytes that go on the wire. Pure
// functions of their arguments.
#pragma once

#include <netinet/in.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

namespace leasehold::http_detail {

struct Request {
  bool head = false;                          // HEAD: the answer without its body
  std::string path;                           // percent-decoded
  std::map<std::string, std::string> params;  // the query, decoded; the first of each name
};

struct Reply {
  int status = 200;
  std::string content_type;
  std::string body;
  bool no_cache = false;
};

// A client's text in a message: cut, and valid JSON whatever its bytes.
std::string shown(std::string_view text);
// JSON text; invalid UTF-8 from a client becomes U+FFFD, never an exception.
std::string json_text(const nlohmann::json& j);
// {"error": message} with `status`.
Reply error_reply(int status, const std::string& message);
// The status line and headers of an answer.
std::string head_text(int status, std::string_view content_type, std::optional<size_t> length,
                      bool keep_alive, bool no_cache, bool chunked);
// A whole answer (without its body for a HEAD).
std::string reply_text(const Reply& r, bool keep_alive, bool head_only);
// An origin-form target ("/path?query") as a Request; nullopt when it is
// not one or its escapes are bad.
std::optional<Request> parse_target(std::string_view target, bool head);
// A query parameter as a number; `fallback` when absent. Throws
// std::invalid_argument naming it when it is not one.
uint64_t number_param(const Request& req, const char* name, uint64_t fallback);

// A Host header's value, parsed (RFC 9110 §7.2: uri-host [":" port]).
struct HostName {
  enum class Kind { kName, kIpv4, kIpv6 } kind = Kind::kName;
  std::string name;  // lower case; for kIpv4/kIpv6, the address as written
  in_addr v4{};
  in6_addr v6{};
};

// nullopt unless `value` is a DNS name, an IPv4 address or a bracketed
// IPv6 address, then nothing or ":PORT" (digits only). Exact: no user
// info, no path, no trailing text ("127.0.0.1:80@evil.example" is not one).
std::optional<HostName> parse_host(std::string_view value);
// What a loopback endpoint serves: "localhost", 127.0.0.0/8 and ::1 exactly.
bool is_loopback_host(const HostName& h);

}  // namespace leasehold::http_detail
