// JSON as the client prints it. Every string the coordinator sends is made
// printable there; should one still not be UTF-8 (an older coordinator, a
// store written before), the bad bytes become U+FFFD instead of the whole
// command failing.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace leasehold {

inline std::string json_text(const nlohmann::json& j, int indent = 2) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace leasehold
