// Text from a peer made safe to log and to put in JSON: control characters
// (a newline would forge a log line) and bytes that are not UTF-8 (a JSON
// reply could not be encoded) become \xNN, code points that mislead a
// reader (C1 controls, line separators, bidirectional overrides) \uNNNN,
// and it is cut to `max_bytes`.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace leasehold {

inline constexpr size_t kMaxPrintableBytes = 4096;
std::string printable(std::string_view text, size_t max_bytes = kMaxPrintableBytes);
// Whether `text` is already printable (nothing would be escaped) and at most
// kMaxPrintableBytes long: for values that are refused rather than escaped.
bool is_printable(std::string_view text);
// printable(text, max_bytes) in single quotes: a peer's value quoted in an
// error, so that it cannot forge a log line or break a JSON reply.
inline std::string in_quotes(std::string_view text, size_t max_bytes = kMaxPrintableBytes) {
  return "'" + printable(text, max_bytes) + "'";
}

}  // namespace leasehold
