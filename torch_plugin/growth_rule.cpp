#include "torch_plugin/growth_rule.h"

namespace leasehold::torch_plugin {

GrowthRule::Ask GrowthRule::ask(uint64_t leased, bool leased_known, uint64_t bytes,
                                bool last_resort, bool nothing_to_spill,
                                Clock::time_point now) const {
  Ask a;
  a.needed = last_resort && (guaranteed_ == 0 || nothing_to_spill);
  // leased + bytes > guaranteed, without overflow.
  a.growth = guaranteed_ != 0 && !a.needed && leased_known &&
             (leased > guaranteed_ || bytes > guaranteed_ - leased);
  a.held_back = a.growth && now < no_growth_until_;
  a.wait_ms = a.growth ? 0 : -1;
  return a;
}

void GrowthRule::refused_for_space(const Ask& a, Clock::time_point now) {
  if (a.growth && !a.held_back) no_growth_until_ = now + kBackoff;
}

}  // namespace leasehold::torch_plugin
