#include "shared/printable.h"

#include <cstdint>
#include <cstdio>

namespace leasehold {
namespace {

// Length of the valid UTF-8 sequence starting at `i` (0: invalid), and its
// code point in `*cp`: no overlong forms, no surrogates, nothing past
// U+10FFFF.
size_t utf8_length(std::string_view s, size_t i, uint32_t* cp_out) {
  const auto c = static_cast<unsigned char>(s[i]);
  const size_t n = (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  uint32_t cp = c & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) {
    const auto b = static_cast<unsigned char>(s[i + k]);
    if ((b >> 6) != 0x2) return 0;
    cp = (cp << 6) | (b & 0x3f);
  }
  const uint32_t least[] = {0, 0, 0x80, 0x800, 0x10000};
  if (cp < least[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  *cp_out = cp;
  return n;
}

// Code points that are valid but would mislead a reader of a log line or a
// terminal: C1 controls, line and paragraph separators, and the
// bidirectional overrides and isolates (which can make text read backwards).
bool misleading(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9f) || cp == 0x2028 || cp == 0x2029 ||
         (cp >= 0x202a && cp <= 0x202e) || (cp >= 0x2066 && cp <= 0x2069);
}

}  // namespace

std::string printable(std::string_view text, size_t max_bytes) {
  std::string out;
  out.reserve(std::min(text.size(), max_bytes));
  for (size_t i = 0; i < text.size() && out.size() < max_bytes;) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
      ++i;
    } else if (uint32_t cp = 0; size_t n = c >= 0x80 ? utf8_length(text, i, &cp) : 0) {
      if (misleading(cp)) {
        char esc[12];
        std::snprintf(esc, sizeof esc, "\\u%04x", static_cast<unsigned>(cp));
        out += esc;
      } else {
        out.append(text, i, n);
      }
      i += n;
    } else {
      char hex[5];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
      ++i;
    }
  }
  return out;
}

bool is_printable(std::string_view text) {
  return text.size() <= kMaxPrintableBytes && printable(text, SIZE_MAX) == text;
}

}  // namespace leasehold
