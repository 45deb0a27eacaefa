// Mixed precision in the manner of PyTorch's autocast: while an
// AutocastGuard for bfloat16 lives on a thread, the linear layers it runs
// on CUDA multiply bfloat16 copies of their input and weight on tensor
// cores, accumulating and returning float32, and scaled dot-product
// attention runs its products in bfloat16 on tensor cores the same way
// (float32 softmax statistics); parameters, optimiser state, activations,
// norms, softmax and the loss stay float32. A linear layer's backward uses
// the same bfloat16 copies (which is what it keeps for it: half the bytes
// of the float32 input). On the CPU nothing changes: it computes in
// float32, the reference the CUDA results are checked against.
#pragma once

#include <optional>

#include "agent/engine/dtype.h"

namespace leasehold::engine {

class AutocastGuard {
 public:
  // nullopt turns autocast off inside the scope. REQUIRES: BFloat16 or nullopt.
  explicit AutocastGuard(std::optional<DType> dtype);
  ~AutocastGuard();
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  std::optional<DType> previous_;
};

// The lower precision of GEMMs on `device` on this thread now, if any.
std::optional<DType> autocast_dtype(Device device);

}  // namespace leasehold::engine
