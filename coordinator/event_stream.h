// The events the HTTP endpoint streams (/api/events): the loop appends, and
// the endpoint's thread takes, for each open stream, what that stream has
// not sent yet. Bounded: the latest kKept events are kept, and a stream
// that fell further behind skips to them (it is told how many it missed).
// The loop never waits for a reader, and a reader never waits here: the
// endpoint is told to look again when an event is pushed.
//
// Thread safety: every member may be called from any thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace leasehold {

class EventStream {
 public:
  static constexpr size_t kKept = 1024;

  // Appends one event (a JSON text).
  void push(std::string event);
  // Refuses readers from now on (the server stops).
  void close();

  using Event = std::shared_ptr<const std::string>;
  struct Batch {
    std::vector<Event> events;  // shared: readers copy pointers, not texts
    uint64_t missed = 0;        // events dropped before this reader got them
  };
  // The events after `cursor` (advanced past them), at once; none when
  // there are none yet. A new reader starts at end().
  Batch take(uint64_t& cursor) const;
  uint64_t end() const;

  // Readers attached now; the loop renders events only while there are any.
  bool has_readers() const;
  // Takes a reader's place if fewer than `max` are attached and the stream
  // is not closed; each successful attach is paired with one detach.
  bool attach(int max);
  void detach();

 private:
  mutable std::mutex mu_;
  std::deque<Event> events_;
  uint64_t first_ = 0;  // sequence number of events_.front()
  int readers_ = 0;
  bool closed_ = false;
};

}  // namespace leasehold
