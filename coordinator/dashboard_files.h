// The dashboard page's files (coordinator/dashboard/), embedded in the
// binary at build time (cmake/embed_files.cmake), so the page works on a
// machine without internet access or an installed share directory.
#pragma once

#include <string_view>

namespace leasehold {

struct DashboardFile {
  std::string_view name;          // "index.html"
  std::string_view content_type;  // "text/html; charset=utf-8"
  std::string_view bytes;
};

// nullptr when there is no such file.
const DashboardFile* find_dashboard_file(std::string_view name);

}  // namespace leasehold
