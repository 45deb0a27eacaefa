// Mixed precision in the manner of PyTorch's autocast: while an
// AutocastGuard for bfloat16 lives on a thread, the linear layers it runs
// on CUDA multiply bfloat16 copies of their input and weight on tensor
// cores, accumulating in float32, and scaled dot-product attention runs its
// products in bfloat16 on tensor cores the same way (float32 softmax
// statistics). Parameters, optimiser state, norms' statistics, softmax,
// the loss and the residual stream stay float32. A product's or a norm's
// result is float32, except where the model asks for bfloat16 because a
// product reads it next (ops.h: ProductOut, linear_gelu; the GPT block
// keeps its norms' outputs, its qkv projection, the attention's output and
// the MLP's hidden layer so), or where a branch's product output joins the
// residual stream through add_dropout (proj's and fc2's): those operators
// take bfloat16 inputs as they are, and a gradient has its tensor's type.
// A linear layer's backward uses the bfloat16 copies it multiplied (half
// the bytes of float32 to keep). On the CPU nothing changes: it computes in
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
