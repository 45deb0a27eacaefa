// The client's region commands: `leasehold regions` (table or JSON) and
// `leasehold regions drop NAME`. Exit codes as the job commands
// (client/jobs.h): 0 done, 2 invalid input (no such region, or it is in
// use), 4 the coordinator could not be reached.
#pragma once

#include <string>

#include <nlohmann/json.hpp>

#include "client/jobs.h"
#include "schemas/leasehold_generated.h"

namespace leasehold::client {

// Field names are a stable interface (see README).
nlohmann::json regions_to_json(const proto::RegionList& list);
std::string regions_to_table(const proto::RegionList& list);

int list_regions(const Context& ctx);
int drop_region(const Context& ctx, const std::string& name);

}  // namespace leasehold::client
