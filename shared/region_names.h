// Names of shared cache regions (coordinator/regions.md), shared by the
// coordinator, which checks them, and the agent and job validation, which
// make them.
#pragma once

#include <string>
#include <string_view>

namespace leasehold {

// 1-128 letters, digits, '.', '_', '-', ':' and '/', not starting with '/'.
bool valid_region_name(std::string_view name);

// The region a job's `publish_parameters` / `init_from` NAME refers to.
std::string parameters_region(std::string_view name);

}  // namespace leasehold
