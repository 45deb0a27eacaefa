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

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "agent/engine/dtype.h"
#include "agent/engine/tensor.h"

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

// Autocast's bfloat16 copies of parameters, made once for a training step
// instead of once per product (PyTorch's autocast caches its casts of
// parameters for the length of its region for the same reason). While one
// lives on a thread, a product under autocast that reads one of `params`
// (a linear layer's weight, or its bias for a bfloat16 result) reads its
// copy, until release() (of all, or of some). The copies are made in one
// pass (a launch per kernels::kMaxConvertTensors tensors) and have the
// bits of the conversion each product would have made: the results are
// the same bits. Only
// float32 tensors on a device with autocast on get copies (so none on the
// CPU, nor where no AutocastGuard lives); the others are passed over.
// Scopes nest; a lookup sees the innermost's copies first, then the outer
// ones', and a scope copies only the parameters no enclosing one has a
// copy of, nor one handed to it made (`made`: a segment recorded within a
// run again takes its weights' copies from the scope it was recorded in
// and hands them to its own backward's, recompute.h).
// REQUIRES: nothing writes `params` while it lives (it spans a step's
// forward and backward; the optimizer writes them after it is gone);
// scopes on a thread end in the reverse order of their making (one that
// ends out of order terminates the process: lookups would read a dead
// scope). A product with a float32 result reads its bias as it is, so a
// layer of float32 results has a bias copy no one reads (the GPT's layers
// all keep bfloat16).
class AutocastWeights {
 public:
  // `made`: copies of some of `params`, (parameter, its bfloat16 copy), as
  // copies_of gave them, this scope's without converting them again.
  explicit AutocastWeights(const std::vector<Tensor>& params,
                           std::vector<std::pair<Tensor, Tensor>> made = {});
  ~AutocastWeights();
  AutocastWeights(const AutocastWeights&) = delete;
  AutocastWeights& operator=(const AutocastWeights&) = delete;

  // The copy of `t` made here or in an enclosing scope, if any.
  const Tensor* find(const Tensor& t) const;
  // The copies of those of `params` that this scope or an enclosing one
  // holds, as (parameter, copy): held by the caller too from then on.
  std::vector<std::pair<Tensor, Tensor>> copies_of(const std::vector<Tensor>& params) const;
  // Lets its copies go (this scope's only): from then on each lives as
  // long as something else holds it (the saved tensors of the products
  // that read it), and a product finds none here and converts its own. A
  // step calls it after its forward pass, and a recomputed segment after
  // its run again (recompute.cpp): the copies no product saved (a bias's)
  // are then not held through backward, where a step is short of memory.
  // (Blocks that recompute let theirs go earlier, below.)
  void release() { copies_.clear(); }
  // Lets the copies of `params` go, from this scope and those it nests in
  // (the others stay): a transformer block that recomputes in backward
  // once its forward has read them (nn.h), where they would otherwise be
  // held to the forward pass's end, the step's peak where such a step is
  // short of memory.
  void release(const std::vector<Tensor>& params);
  size_t copies() const { return copies_.size(); }
  // Conversion passes scopes have made on this thread so far (one per
  // scope that converted anything, however many launches it took): what
  // tests count.
  static uint64_t passes_on_this_thread();

 private:
  std::vector<std::pair<Tensor, Tensor>> copies_;  // (parameter, its bfloat16 copy)
  AutocastWeights* outer_;
};

// The innermost AutocastWeights live on this thread, if any.
AutocastWeights* autocast_weights();

// The bfloat16 tensor autocast multiplies for float32 `t`: its copy from a
// live AutocastWeights on this thread, else a conversion made now (not
// recorded by autograd: a product's backward sends the gradient to `t`).
Tensor autocast_copy(const Tensor& t);

}  // namespace leasehold::engine
