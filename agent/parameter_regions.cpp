#include "agent/parameter_regions.h"

#include <spdlog/spdlog.h>

#include <map>
#include <thread>

#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/region_tensors.h"

namespace leasehold {
namespace {

namespace E = engine;

std::string describe(const E::Tensor& t) { return t.shape_str() + " " + dtype_name(t.dtype()); }

// How long a publisher waits for a region another agent is attached to (a
// job starting from it holds it only while it copies).
constexpr std::chrono::seconds kPublishPatience{10};

}  // namespace

void init_parameters(AgentSession& session, const std::string& region,
                     const E::nn::NamedTensors& params, const std::string& job) {
  std::shared_ptr<RegionAttachment> attachment;
  try {
    attachment = std::make_shared<RegionAttachment>(session.attach_region(region, 0, false));
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NoSuchRegion) throw;
    throw std::runtime_error("init_from: " + std::string(e.what()) +
                             " (a job publishes it with publish_parameters; regions do not "
                             "survive a coordinator restart, and an unattached one may be "
                             "evicted: the publisher's checkpoint is the durable copy)");
  }
  std::map<std::string, E::Tensor> stored;
  for (auto& [name, t] : regions::read_tensors(attachment)) stored[name] = t;
  const std::string what = "init_from: region '" + region + "'";
  for (const auto& [name, p] : params) {
    auto it = stored.find(name);
    if (it == stored.end()) throw std::runtime_error(what + " has no parameter '" + name + "'");
    if (it->second.sizes() != p.sizes() || it->second.dtype() != p.dtype()) {
      throw std::runtime_error(what + " does not match the model: its '" + name + "' is " +
                               describe(it->second) + ", the model's " + describe(p));
    }
  }
  if (stored.size() != params.size()) {
    throw std::runtime_error(what + " does not match the model: it holds " +
                             std::to_string(stored.size()) + " tensors, the model has " +
                             std::to_string(params.size()) + " parameters");
  }
  {
    E::NoGradGuard no_grad;
    for (const auto& [name, p] : params) p.detach().copy_(stored[name]);
  }
  spdlog::info("job '{}': parameters from region '{}' ({} tensors, digest {:016x})", job, region,
               params.size(), regions::tensors_digest(params));
}

void publish_parameters(AgentSession& session, const std::string& region,
                        const E::nn::NamedTensors& params, const std::string& job) {
  uint64_t bytes = 0;
  try {
    bytes = regions::packed_size(regions::specs_of(params));
    const auto deadline = std::chrono::steady_clock::now() + kPublishPatience;
    for (auto pause = std::chrono::milliseconds(20);;
         pause = std::min<std::chrono::milliseconds>(pause * 2, std::chrono::milliseconds(500))) {
      try {
        RegionAttachment attachment = session.attach_region(region, bytes, true, std::nullopt,
                                                            /*replace=*/true);
        try {
          regions::write_tensors(attachment, params);
        } catch (...) {
          // Copies queued before the failure must finish before the
          // attachment (and with it the memory) goes back.
          try {
            E::fence_device(regions::region_device(attachment));
          } catch (const std::exception& e) {
            spdlog::error("region '{}': {}", region, e.what());
          }
          throw;
        }
        attachment.mark_ready();
        break;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::RegionBusy || std::chrono::steady_clock::now() > deadline) throw;
        std::this_thread::sleep_for(pause);
      }
    }
  } catch (const std::exception& e) {
    throw std::runtime_error("publish_parameters: training finished, but region '" + region +
                             "' could not be published: " + e.what() +
                             " (the checkpoint holds the parameters)");
  }
  spdlog::info("job '{}': published parameters to region '{}' ({} tensors, {} bytes, digest "
               "{:016x})",
               job, region, params.size(), bytes, regions::tensors_digest(params));
}

}  // namespace leasehold
