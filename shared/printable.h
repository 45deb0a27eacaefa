// Text from a peer made safe to log and to put in JSON: control characters
// (a newline would forge a log line) and bytes that are not UTF-8 (a JSON
// reply could not be encoded) become \xNN, and it is cut to `max_bytes`.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace leasehold {

std::string printable(std::string_view text, size_t max_bytes = 4096);

}  // namespace leasehold
