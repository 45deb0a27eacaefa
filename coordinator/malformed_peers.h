// Bookkeeping for peers that send malformed messages: how many each sent,
// which are ignored (malformed_limit reached), and a log line per interval
// rather than one per message. Bounded under a flood of connections: at
// most kTracked peers are counted and kIgnoredKept remembered as ignored
// (the oldest forgotten first; a forgotten one starts afresh).
//
// Thread safety: the loop's only.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <unordered_map>
#include <unordered_set>

namespace leasehold {

class MalformedPeers {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kTracked = 4096;
  static constexpr size_t kIgnoredKept = 65536;
  static constexpr auto kLogInterval = std::chrono::seconds(10);

  explicit MalformedPeers(uint32_t limit) : limit_(limit) {}

  // Whether messages from `peer` are dropped unread; counts the drop.
  bool drop(const std::string& peer);
  // Counts a malformed message from `peer`, described by `why`; returns the
  // text of the error to send it (saying so when it is ignored from now on).
  std::string reject(const std::string& peer, const std::string& why);
  // The log line for what happened since the last one, once per
  // kLogInterval (at once with `force`); empty when nothing is due.
  std::string take_log_line(Clock::time_point now, bool force);

 private:
  uint32_t limit_;
  std::unordered_map<std::string, uint32_t> count_by_peer_;
  std::unordered_set<std::string> ignored_;
  std::deque<std::string> ignored_order_;
  uint64_t since_log_ = 0, dropped_ = 0, peers_ignored_ = 0;
  std::string latest_;
  Clock::time_point logged_{};
};

}  // namespace leasehold
