// Tensor → TensorImpl (sizes, strides, storage offset, dtype, autograd
// fields) → Storage (reference counted) → Allocator. Copying a Tensor copies
// a handle; views share the Storage. Operators live in ops.h.
//
// Thread safety: a Tensor may be read from several threads; mutating one
// (set_requires_grad, grad, in-place updates) needs external locking.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "agent/engine/allocator.h"
#include "agent/engine/dtype.h"

namespace leasehold::engine {

class Node;
using Shape = std::vector<int64_t>;

struct TensorOptions {
  DType dtype = DType::Float32;
  Device device = Device::cpu();
  TensorOptions& with(DType d) { dtype = d; return *this; }
  TensorOptions& on(Device d) { device = d; return *this; }
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape sizes;
  Shape strides;            // in elements
  int64_t offset = 0;       // in elements
  DType dtype = DType::Float32;
  // Autograd.
  bool requires_grad = false;            // leaves only; results use grad_fn
  std::shared_ptr<TensorImpl> grad;
  std::shared_ptr<Node> grad_fn;
  // A leaf's one gradient accumulator while a graph uses it: every use of
  // the leaf in a graph (a weight tied to two layers) feeds the same node,
  // so its gradient is summed first and accumulated once.
  std::weak_ptr<Node> grad_accumulator;
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  bool defined() const { return impl_ != nullptr; }
  const Shape& sizes() const { return impl_->sizes; }
  const Shape& strides() const { return impl_->strides; }
  int64_t dim() const { return static_cast<int64_t>(impl_->sizes.size()); }
  // Size of dimension `d`; negative counts from the end. Throws when out of range.
  int64_t size(int64_t d) const;
  int64_t numel() const;
  int64_t storage_offset() const { return impl_->offset; }
  DType dtype() const { return impl_->dtype; }
  Device device() const { return impl_->storage->device(); }
  TensorOptions options() const { return {dtype(), device()}; }
  bool is_contiguous() const;
  // Pointer to element 0. Throws when T does not match dtype().
  template <class T>
  T* data() const;
  void* raw_data() const;

  // Autograd.
  bool requires_grad() const;  // leaf flag or has a grad_fn
  // REQUIRES: a leaf of a floating dtype.
  Tensor& set_requires_grad(bool value);
  bool is_leaf() const { return impl_->grad_fn == nullptr; }
  const std::shared_ptr<Node>& grad_fn() const { return impl_->grad_fn; }
  Tensor grad() const { return impl_->grad ? Tensor(impl_->grad) : Tensor(); }
  void set_grad(const Tensor& g) { impl_->grad = g.impl_; }
  // Computes gradients of this tensor with respect to the leaves it depends
  // on and accumulates them into their grad(). `gradient` is required unless
  // this tensor has one element. Throws on a second call through freed
  // buffers unless retain_graph was set on the first.
  void backward(const Tensor& gradient = {}, bool retain_graph = false) const;
  // The same data, cut from the graph.
  Tensor detach() const;

  // Views (share storage; differentiable) and copies.
  Tensor view(Shape shape) const;     // REQUIRES: compatible strides; -1 infers one size
  Tensor reshape(Shape shape) const;  // a view when possible, else a copy
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor permute(Shape dims) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor expand(Shape shape) const;   // broadcasting view (stride 0)
  Tensor unsqueeze(int64_t dim) const;
  Tensor flatten(int64_t start_dim = 0, int64_t end_dim = -1) const;
  Tensor contiguous() const;
  Tensor clone() const;
  Tensor to(Device device) const;
  Tensor to(DType dtype) const;

  // Copies `src` (same shape) into this tensor in place, across devices and
  // views. Not recorded by autograd.
  void copy_(const Tensor& src);
  void fill_(double value);

  // Host-side reads (synchronize with the device).
  double item() const;  // REQUIRES: one element
  template <class T>
  std::vector<T> to_vector() const;

  std::string shape_str() const;
  const std::shared_ptr<TensorImpl>& impl() const { return impl_; }

 private:
  std::shared_ptr<TensorImpl> impl_;
};

// Factories. Memory comes from current_allocator(options.device).
Tensor empty(const Shape& sizes, TensorOptions options = {});
Tensor zeros(const Shape& sizes, TensorOptions options = {});
Tensor ones(const Shape& sizes, TensorOptions options = {});
Tensor full(const Shape& sizes, double value, TensorOptions options = {});
Tensor scalar_tensor(double value, TensorOptions options = {});
template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& sizes, Device device = Device::cpu());
// A contiguous tensor over memory it does not own (`data` on
// options.device, e.g. a shared cache region); `keepalive` (the memory's
// owner) is held as long as the tensor or any view of it lives.
Tensor from_blob(void* data, const Shape& sizes, TensorOptions options,
                 std::shared_ptr<void> keepalive);
// Uniform [low, high) (high itself only by rounding) and normal(mean, std)
// draws from the engine's generator. rand is counter-based (one seed from
// the generator per tensor) and filled on the tensor's device: the same
// values on CPU and GPU.
Tensor rand(const Shape& sizes, TensorOptions options = {}, double low = 0, double high = 1);
Tensor randn(const Shape& sizes, TensorOptions options = {}, double mean = 0, double std = 1);
Tensor arange(int64_t n, TensorOptions options = {});

// The engine's random generator (parameter init, dropout seeds, shuffles).
void manual_seed(uint64_t seed);
uint64_t next_random_u64();

// The random numbers of one training step. While one lives on this thread,
// a random op (dropout) takes the seed splitmix(seed, n) for the n-th such
// op of the scope instead of drawing from the generator, and its kernel
// mixes in the value of `step` (an int64 scalar on the op's device; the
// optimizer's step counter) where it runs. So a step's masks depend on the
// seed, the step's number and the op's place in the step alone: a step
// captured as a CUDA graph and replayed draws what the same step run op by
// op draws, and a resumed run what the uninterrupted run drew. Ops on
// another device than `step`'s use the seed alone.
class StepRandom {
 public:
  StepRandom(uint64_t seed, Tensor step);
  ~StepRandom();
  StepRandom(const StepRandom&) = delete;
  StepRandom& operator=(const StepRandom&) = delete;

 private:
  friend struct RandomDraw;
  friend struct RandomPlace;
  friend class RandomReplay;
  uint64_t seed_;
  Tensor step_;
  uint64_t drawn_ = 0;
  StepRandom* previous_;
};

// Where the StepRandom in scope is: its seed, its step counter and how many
// random ops have drawn from it so far.
struct RandomPlace {
  uint64_t seed = 0;
  Tensor step;
  uint64_t drawn = 0;
  // Where this thread's StepRandom is now; nullopt without one (draws then
  // come from the generator and cannot be repeated).
  static std::optional<RandomPlace> here();
};

// While one lives on this thread, random ops draw from `place` on, as they
// did when it was taken (a segment of the forward run again in backward,
// recompute.h, draws the masks it drew the first time), whatever scope is
// current; the scope before comes back when it ends.
class RandomReplay {
 public:
  explicit RandomReplay(const RandomPlace& place);
  RandomReplay(const RandomReplay&) = delete;
  RandomReplay& operator=(const RandomReplay&) = delete;

 private:
  StepRandom scope_;
};

// The seed of the next random op on `device` (see StepRandom) and, inside a
// StepRandom, its step counter there (undefined otherwise), which the draw
// holds so that a backward that draws its mask again can read it.
struct RandomDraw {
  uint64_t seed = 0;
  Tensor step;
  const int64_t* step_data() const { return step.defined() ? step.data<int64_t>() : nullptr; }
  static RandomDraw next(Device device);
};

int64_t numel_of(const Shape& s);
Shape contiguous_strides(const Shape& sizes);
std::string shape_to_string(const Shape& s);

}  // namespace leasehold::engine
