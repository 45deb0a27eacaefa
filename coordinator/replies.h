// Reply bodies the core builds (object API; the broker encodes them).
#pragma once

#include <memory>
#include <string>

#include "coordinator/effects.h"
#include "coordinator/lease_table.h"
#include "schemas/leasehold_generated.h"
#include "shared/device.h"

namespace leasehold {

// `rec` of device `device`'s lease table, as the wire says it.
std::unique_ptr<proto::LeaseT> lease_object(const LeaseRecord& rec, int device);
std::unique_ptr<proto::PoolInfoT> pool_info_object(const PoolDescriptor& desc);

// Appends a message with `body` (any table of the Body union) to `out`;
// `after_store`, `job`: see OutMessage.
template <class T>
void send(Effects& out, const std::string& to, uint64_t request_id, T&& body,
          bool after_store = false, uint64_t job = 0) {
  OutMessage m;
  m.to = to;
  m.request_id = request_id;
  m.body.Set(std::forward<T>(body));
  m.after_store = after_store;
  m.job = job;
  out.messages.push_back(std::move(m));
}
void send_error(Effects& out, const std::string& to, uint64_t request_id, ErrorCode code,
                const std::string& message, bool after_store = false);
void send_ack(Effects& out, const std::string& to, uint64_t request_id, bool after_store = false);

}  // namespace leasehold
