#include "agent/engine/autocast.h"

#include <stdexcept>

namespace leasehold::engine {
namespace {
thread_local std::optional<DType> t_autocast;
}  // namespace

AutocastGuard::AutocastGuard(std::optional<DType> dtype) : previous_(t_autocast) {
  if (dtype && *dtype != DType::BFloat16) {
    throw std::invalid_argument(std::string("autocast: ") + dtype_name(*dtype) +
                                " is not a lower precision (bfloat16 is)");
  }
  t_autocast = dtype;
}

AutocastGuard::~AutocastGuard() { t_autocast = previous_; }

std::optional<DType> autocast_dtype(Device device) {
  return device.is_cuda() ? t_autocast : std::nullopt;
}

}  // namespace leasehold::engine
