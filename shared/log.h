// Logging set-up shared by the programs: spdlog to stderr (the journal under
// systemd), level from configuration.
#pragma once

#include <string_view>

namespace leasehold {

// Accepts trace, debug, info, warn, error, critical, off. Throws
// std::invalid_argument naming the level otherwise.
void init_logging(std::string_view level, std::string_view program);

}  // namespace leasehold
