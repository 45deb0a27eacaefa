// A job's parameters through shared cache regions (coordinator/regions.md):
// `publish_parameters` leaves a job's final weights in params/NAME and
// `init_from` starts a job from them. Checkpoints stay the durable copy.
#pragma once

#include <string>

#include "agent/engine/nn.h"
#include "lease_client/session.h"

namespace leasehold {

// Copies the parameters published in `region` into `params`, checked name
// by name for shape and dtype first (nothing is copied on a mismatch), and
// logs their digest. Throws std::runtime_error naming the region (absent,
// evicted, not matching the model).
void init_parameters(AgentSession& session, const std::string& region,
                     const engine::nn::NamedTensors& params, const std::string& job);

// Publishes `params` to `region`, replacing an unattached one of that name
// (waiting up to 10 s while another agent is briefly attached to it), and
// logs their digest. Throws std::runtime_error naming the region.
void publish_parameters(AgentSession& session, const std::string& region,
                        const engine::nn::NamedTensors& params, const std::string& job);

}  // namespace leasehold
