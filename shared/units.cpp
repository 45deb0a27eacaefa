#include "shared/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>

namespace leasehold {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// Splits "1.5GiB" into 1.5 and "gib". Throws when there is no leading number.
std::pair<double, std::string> split_number(std::string_view text, const char* what) {
  std::string s(trim(text));
  if (s.empty()) throw std::invalid_argument(std::string("empty ") + what);
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(s, &used);
  } catch (const std::exception&) {
    throw std::invalid_argument("invalid " + std::string(what) + " '" + std::string(text) +
                                "': expected a number with an optional unit");
  }
  if (!std::isfinite(value) || value < 0) {
    throw std::invalid_argument("invalid " + std::string(what) + " '" + std::string(text) +
                                "': must be a finite, non-negative number");
  }
  return {value, lower(trim(std::string_view(s).substr(used)))};
}

}  // namespace

uint64_t parse_bytes(std::string_view text) {
  auto [value, unit] = split_number(text, "size");
  static const std::pair<const char*, double> kUnits[] = {
      {"", 1.0},          {"b", 1.0},
      {"k", 1e3},         {"kb", 1e3},        {"m", 1e6},         {"mb", 1e6},
      {"g", 1e9},         {"gb", 1e9},        {"t", 1e12},        {"tb", 1e12},
      {"kib", 1024.0},    {"mib", 1048576.0}, {"gib", 1073741824.0},
      {"tib", 1099511627776.0}};
  for (const auto& [name, scale] : kUnits) {
    if (unit == name) {
      double bytes = std::round(value * scale);
      if (bytes >= 18446744073709551616.0) {
        throw std::out_of_range("size '" + std::string(text) + "' does not fit in 64 bits");
      }
      return static_cast<uint64_t>(bytes);
    }
  }
  throw std::invalid_argument("invalid size '" + std::string(text) + "': unknown unit '" + unit +
                              "' (use B, KiB, MiB, GiB, TiB, KB, MB, GB, TB)");
}

double parse_fraction(std::string_view text) {
  std::string_view t = trim(text);
  bool percent = !t.empty() && t.back() == '%';
  auto [value, rest] = split_number(percent ? t.substr(0, t.size() - 1) : t, "share");
  if (percent) value /= 100;
  if (!rest.empty() || value <= 0 || value > 1) {
    throw std::invalid_argument("invalid share '" + std::string(text) +
                                "': expected 0.8 or 80%, in (0, 1]");
  }
  return value;
}

SizeSpec parse_size_spec(std::string_view text) {
  std::string_view t = trim(text);
  if (!t.empty() && t.back() == '%') {
    auto [value, rest] = split_number(t.substr(0, t.size() - 1), "percentage");
    if (!rest.empty() || value <= 0 || value > 100) {
      throw std::invalid_argument("invalid size '" + std::string(text) +
                                  "': a percentage must be in (0, 100]");
    }
    return SizeSpec{0, value};
  }
  return SizeSpec{parse_bytes(t), 0.0};
}

uint64_t SizeSpec::resolve(uint64_t free_bytes) const {
  if (percent <= 0) return bytes;
  return static_cast<uint64_t>(static_cast<double>(free_bytes) * (percent / 100.0));
}

std::string SizeSpec::to_string() const {
  if (percent > 0) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g%%", percent);
    return buf;
  }
  return format_bytes(bytes);
}

std::chrono::milliseconds parse_duration(std::string_view text) {
  auto [value, unit] = split_number(text, "duration");
  double ms;
  if (unit.empty() || unit == "s") {
    ms = value * 1e3;
  } else if (unit == "ms") {
    ms = value;
  } else if (unit == "us") {
    ms = value / 1e3;
  } else if (unit == "m" || unit == "min") {
    ms = value * 60e3;
  } else if (unit == "h") {
    ms = value * 3600e3;
  } else if (unit == "d") {
    ms = value * 86400e3;
  } else {
    throw std::invalid_argument("invalid duration '" + std::string(text) + "': unknown unit '" +
                                unit + "' (use us, ms, s, m, h, d)");
  }
  if (ms > 1e15) throw std::out_of_range("duration '" + std::string(text) + "' is too long");
  return std::chrono::milliseconds(static_cast<int64_t>(std::llround(ms)));
}

std::string format_bytes(uint64_t bytes) {
  static const char* kNames[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  int i = 0;
  while (v >= 1024.0 && i < 6) {
    v /= 1024.0;
    ++i;
  }
  char buf[32];
  if (i == 0) {
    std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(bytes));
  } else {
    std::snprintf(buf, sizeof buf, "%.2f %s", v, kNames[i]);
  }
  return buf;
}

uint64_t unix_time_us() {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                   std::chrono::system_clock::now().time_since_epoch())
                                   .count());
}

}  // namespace leasehold
