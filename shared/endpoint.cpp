#include "shared/endpoint.h"

#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <system_error>

namespace leasehold {

std::string default_endpoint() {
  if (const char* env = std::getenv(kEndpointEnv); env && *env) return env;
  if (const char* xdg = std::getenv("XDG_RUNTIME_DIR"); xdg && *xdg) {
    return std::string("ipc://") + xdg + "/leasehold/coordinator.sock";
  }
  return "ipc:///run/leasehold/coordinator.sock";
}

std::optional<std::string> ipc_path(std::string_view endpoint) {
  constexpr std::string_view kPrefix = "ipc://";
  if (endpoint.substr(0, kPrefix.size()) != kPrefix) return std::nullopt;
  return std::string(endpoint.substr(kPrefix.size()));
}

std::string default_events_endpoint(const std::string& endpoint) {
  auto path = ipc_path(endpoint);
  if (!path) return "";
  std::string p = *path;
  const std::string suffix = ".sock";
  if (p.size() > suffix.size() && p.compare(p.size() - suffix.size(), suffix.size(), suffix) == 0) {
    p.resize(p.size() - suffix.size());
  }
  return "ipc://" + p + ".events";
}

std::string default_state_dir() {
  if (const char* s = std::getenv("STATE_DIRECTORY"); s && *s) {
    std::string dirs = s;  // systemd may list several, separated by ':'
    return dirs.substr(0, dirs.find(':'));
  }
  if (const char* x = std::getenv("XDG_STATE_HOME"); x && *x) {
    return std::string(x) + "/leasehold";
  }
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.local/state/leasehold";
  return "/var/lib/leasehold";
}

std::string default_agent_state_dir(const std::string& endpoint) {
  if (const char* s = std::getenv("STATE_DIRECTORY"); s && *s) return default_state_dir();
  std::string slug;
  for (char c : endpoint) {
    const bool plain = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                       c == '.' || c == '-';
    if (plain) {
      slug += c;
    } else if (slug.empty() || slug.back() != '_') {
      slug += '_';
    }
  }
  if (slug.size() > 120) slug = slug.substr(slug.size() - 120);  // the distinctive end
  return default_state_dir() + "/agents/" + slug;
}

}  // namespace leasehold
