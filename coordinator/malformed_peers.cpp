#include "coordinator/malformed_peers.h"

namespace leasehold {

bool MalformedPeers::drop(const std::string& peer) {
  if (!ignored_.count(peer)) return false;
  ++dropped_;
  return true;
}

std::string MalformedPeers::reject(const std::string& peer, const std::string& why) {
  if (count_by_peer_.size() >= kTracked) count_by_peer_.clear();
  const uint32_t n = ++count_by_peer_[peer];
  ++since_log_;
  latest_ = why;
  if (n < limit_) return why;
  // ZeroMQ cannot close one peer of a ROUTER: its messages are dropped
  // unread from now on (a new connection starts afresh).
  count_by_peer_.erase(peer);
  if (ignored_.insert(peer).second) {
    ignored_order_.push_back(peer);
    if (ignored_order_.size() > kIgnoredKept) {
      ignored_.erase(ignored_order_.front());
      ignored_order_.pop_front();
    }
  }
  ++peers_ignored_;
  return why + "; after " + std::to_string(n) +
         " malformed messages (malformed_limit) this connection is ignored";
}

std::string MalformedPeers::take_log_line(Clock::time_point now, bool force) {
  if (since_log_ == 0 && dropped_ == 0) return "";
  if (!force && now - logged_ < kLogInterval) return "";
  std::string line = "rejected " + std::to_string(since_log_) +
                     " malformed messages (latest: " + latest_ + "); " +
                     std::to_string(peers_ignored_) + " connections ignored so far, " +
                     std::to_string(dropped_) + " of their messages dropped";
  since_log_ = 0;
  dropped_ = 0;
  logged_ = now;
  return line;
}

}  // namespace leasehold
