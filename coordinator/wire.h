// Encoding what the core produced into ZeroMQ frames.
#pragma once

#include <string>
#include <zmq.hpp>

#include "coordinator/effects.h"
#include "coordinator/job_table.h"

namespace leasehold {

// The envelope of a reply or push. A message the protocol's size limit
// would make the peer drop becomes an Error that says so.
zmq::message_t encode_message(const OutMessage& m);
// The topic ("job.<id>.") and body (a JobInfo summary) of a job event.
std::string event_topic(uint64_t job_id);
zmq::message_t encode_event(const JobRecord& job);
// The body of another event (a Shrink or ShrinkDone).
zmq::message_t encode_notice(const Notice& notice);

}  // namespace leasehold
