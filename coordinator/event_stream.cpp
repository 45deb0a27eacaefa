#include "coordinator/event_stream.h"

namespace leasehold {

void EventStream::push(std::string event) {
  auto shared = std::make_shared<const std::string>(std::move(event));
  std::lock_guard lock(mu_);
  events_.push_back(std::move(shared));
  if (events_.size() > kKept) {
    events_.pop_front();
    ++first_;
  }
}

void EventStream::close() {
  std::lock_guard lock(mu_);
  closed_ = true;
}

EventStream::Batch EventStream::take(uint64_t& cursor) const {
  std::lock_guard lock(mu_);
  Batch b;
  if (cursor < first_) {
    b.missed = first_ - cursor;
    cursor = first_;
  }
  for (uint64_t i = cursor - first_; i < events_.size(); ++i) b.events.push_back(events_[i]);
  cursor = first_ + events_.size();
  return b;
}

uint64_t EventStream::end() const {
  std::lock_guard lock(mu_);
  return first_ + events_.size();
}

bool EventStream::has_readers() const {
  std::lock_guard lock(mu_);
  return readers_ > 0;
}

bool EventStream::attach(int max) {
  std::lock_guard lock(mu_);
  if (closed_ || readers_ >= max) return false;
  ++readers_;
  return true;
}

void EventStream::detach() {
  std::lock_guard lock(mu_);
  if (readers_ > 0) --readers_;
}

}  // namespace leasehold
