#include "shared/region_names.h"

#include <algorithm>
#include <cctype>

namespace leasehold {

bool valid_region_name(std::string_view name) {
  constexpr size_t kMax = 128;
  if (name.empty() || name.size() > kMax || name.front() == '/') return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' || c == '-' ||
           c == ':' || c == '/';
  });
}

std::string parameters_region(std::string_view name) { return "params/" + std::string(name); }

}  // namespace leasehold
