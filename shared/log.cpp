#include "shared/log.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <stdexcept>
#include <string>

namespace leasehold {

void init_logging(std::string_view level, std::string_view program) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") {
    throw std::invalid_argument("unknown log level '" + std::string(level) +
                                "' (trace, debug, info, warn, error, critical, off)");
  }
  auto logger = spdlog::stderr_color_mt(std::string(program));
  logger->set_level(lvl);
  logger->set_pattern("%Y-%m-%d %H:%M:%S.%e %n[%P] %^%l%$: %v");
  spdlog::set_default_logger(logger);
}

}  // namespace leasehold
