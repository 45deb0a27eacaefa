// Parsing and printing of the sizes and durations that appear in flags and
// configuration files ("4GiB", "90%", "500ms").
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace leasehold {

// A pool size as the operator wrote it: absolute bytes or a share of the
// memory that is free on the device when the pool is created.
struct SizeSpec {
  uint64_t bytes = 0;      // used when percent == 0
  double percent = 0.0;    // (0, 100]; 0 means "absolute"

  // Resolves against the free memory of the device. Never returns more than
  // `free_bytes` for a percentage.
  uint64_t resolve(uint64_t free_bytes) const;
  std::string to_string() const;
};

// Parses "123", "64KiB", "4GiB", "1.5GB" (binary and decimal units, case
// insensitive "b"). Throws std::invalid_argument naming the text on failure,
// and std::out_of_range when the value does not fit in 64 bits.
uint64_t parse_bytes(std::string_view text);

// parse_bytes, or "N%" with 0 < N <= 100.
SizeSpec parse_size_spec(std::string_view text);

// A share in (0, 1]: "0.8" or "80%". Throws std::invalid_argument naming the text.
double parse_fraction(std::string_view text);

// Parses "250ms", "2s", "1.5s", "3m", "2h", "30d", "100us"; a bare number is seconds.
// Throws std::invalid_argument naming the text on failure or when negative.
std::chrono::milliseconds parse_duration(std::string_view text);

// "1.50 GiB", "512 B": for humans; JSON output carries plain byte counts.
std::string format_bytes(uint64_t bytes);

// The system clock now, in Unix microseconds (time stamps shared between
// processes of one host).
uint64_t unix_time_us();

// Rounds `value` up to a multiple of `alignment` (a power of two). Returns 0
// when the result would overflow.
constexpr uint64_t align_up(uint64_t value, uint64_t alignment) {
  uint64_t mask = alignment - 1;
  if (value > UINT64_MAX - mask) return 0;
  return (value + mask) & ~mask;
}
constexpr uint64_t align_down(uint64_t value, uint64_t alignment) {
  return value & ~(alignment - 1);
}
constexpr bool is_power_of_two(uint64_t v) { return v != 0 && (v & (v - 1)) == 0; }

}  // namespace leasehold
