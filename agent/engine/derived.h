// Trading a little compute for memory, finer than recompute.h: a tensor
// that backward can make again from tensors it keeps anyway is saved as
// the recipe, not as its memory. A transformer block's layer norm output
// (12 MiB at nanoGPT's character model's sizes under autocast) is the norm
// of the input that the norm's own backward keeps: made again in backward
// it costs a pass over its bytes, where recomputing the attention half
// that reads it costs its products and attention kernel too. (PyTorch
// users get the same from saved-tensor hooks or selective activation
// checkpointing.)
//
// A block opens a DeriveSavedGuard around the part whose outputs it lets
// backward make again; inside it, the operators that know how their
// output is made from what they keep register it (derive_when_saved):
// layer_norm's output, and whatever else the caller registers. A
// SavedTensor of that memory (any view of it) made while the guard lives
// then keeps the recipe's inputs (through the saved-tensor hooks, so an
// input that spills spills once) and, when backward asks for it, runs the
// recipe in no-grad mode under the autocast mode of its registration, and
// returns the same view of the new memory. A recipe runs the kernels that
// made the tensor, on the same inputs: backward sees the same bits.
//
// Thread safety: registrations are the calling thread's.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "agent/engine/tensor.h"

namespace leasehold::engine {

// The tensor again from `from`: the same sizes and type, contiguous, with
// the values the first run gave (bit for bit, or as the caller of
// derive_when_saved says).
using Derive = std::function<Tensor(const std::vector<Tensor>& from)>;

// Whether a DeriveSavedGuard(true) is on for this thread now.
bool deriving_saved();
// Registrations are made, and taken by saved tensors, only while
// deriving_saved(); they are all forgotten whenever a guard ends with it
// false (saved tensors made before then keep what they took), so an inner
// guard(false) pauses them and its end ends them.
class DeriveSavedGuard {
 public:
  explicit DeriveSavedGuard(bool on);
  ~DeriveSavedGuard();
  DeriveSavedGuard(const DeriveSavedGuard&) = delete;
  DeriveSavedGuard& operator=(const DeriveSavedGuard&) = delete;

 private:
  bool previous_;
};

// When deriving_saved() and grad mode is on: records that `t` (its whole
// memory, contiguous from its start) is derive(from), so that tensors saved for
// backward from t's memory keep `from` and `derive` instead. `derive` and
// what it refers to (a module's parameters) must not change before
// backward. Otherwise does nothing.
void derive_when_saved(const Tensor& t, Derive derive, std::vector<Tensor> from);

namespace detail {
struct Derivation;
// The recipe registered for t's memory now, or null (SavedTensor's).
std::shared_ptr<const Derivation> derivation_of(const Tensor& t);
// Runs it: the whole registered tensor. Throws std::logic_error when the
// recipe gives another shape or type than the first time.
Tensor derive(const Derivation& d);
}  // namespace detail

}  // namespace leasehold::engine
