// Renders a StatusReply for `leasehold status`: a table for people, JSON for
// scripts (field names are a stable interface; see README).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "schemas/leasehold_generated.h"

namespace leasehold {

nlohmann::json status_to_json(const proto::StatusReply& status);
std::string status_to_table(const proto::StatusReply& status);

}  // namespace leasehold
