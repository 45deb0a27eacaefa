// Reverse-mode automatic differentiation. Each differentiable operator
// records a Node whose edges point at the nodes of its inputs and which keeps
// the tensors its backward needs. backward() counts each node's dependencies,
// runs nodes once all gradients for them have arrived, and accumulates into
// leaves through AccumulateGrad nodes.
//
// Saved tensors go through one hook point (SavedTensor): installing
// SavedTensorHooks changes how they are kept between forward and backward
// (the spill store packs them to SSD and unpacks them for backward).
#pragma once

#include <any>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "agent/engine/tensor.h"

namespace leasehold::engine {

class Node;
struct Edge {
  std::shared_ptr<Node> fn;  // null: the input needs no gradient
};

class Node {
 public:
  virtual ~Node() = default;
  // A string of static storage (a literal): traces keep the pointer
  // (backward_node_running).
  virtual const char* name() const = 0;
  // Gradients for each edge in `next`, given the gradient of this node's
  // output; an undefined Tensor means none for that input.
  virtual std::vector<Tensor> apply(const Tensor& grad_output) = 0;
  // What the engine calls: apply, handed the engine's own reference to
  // grad_output, so that a node can let it go before it returns. A
  // recomputed segment's backward is a whole pass of its own, which needs
  // its output's gradient only until its first node has read it: a GPT
  // block's (24 MiB) would otherwise stay through the block's attention
  // backward, where a budgeted step has its peak (recompute.cpp).
  virtual std::vector<Tensor> apply_taking(Tensor grad_output) { return apply(grad_output); }
  // Offered, just before apply, the gradient that other consumers of input
  // 0 have summed for it so far, when there is one: a node whose kernel can
  // add it as it writes its own (one pass, where the sum after would be
  // another over the same tensor) takes it and returns true, and apply's
  // gradient for input 0 then includes it, bit for bit the sum the engine
  // would have made. A transformer's layer norms take their residual
  // stream's gradient so. (A recomputed segment passes it on to its first
  // operator on the input, recompute.cpp: where the segment reads its
  // input more than once, the sum's order is then that of the segment
  // that keeps its activations, not the engine's after the segment.)
  virtual bool fold_into_input0(const Tensor& sum_so_far) {
    (void)sum_so_far;
    return false;
  }
  // Frees saved tensors once backward has used them.
  virtual void release_saved() {}
  // Whether it keeps tensors for backward (a second backward through it
  // then needs retain_graph); a leaf's accumulator keeps none.
  virtual bool saves_tensors() const { return true; }
  std::vector<Edge> next;
  bool released = false;
  // Set by the engine just before apply: no other tensor refers to
  // grad_output's memory, and the engine drops it after apply, so apply
  // may write over it (a gradient of the same shape and type, where a new
  // one would add its size to backward's peak).
  bool grad_output_owned = false;
  // Set by the engine just before apply, where fold_into_input0 took the
  // sum so far: no other tensor refers to that sum's memory (or its
  // caller gave it up: run_backward_from's leaf_sum_writable), and the
  // engine drops it after apply (apply's gradient for input 0 replaces
  // it), so apply may write that gradient over it (a layer norm's over
  // the residual stream's gradient, whole or a recomputed MLP's slice:
  // recompute.cpp).
  bool sum_so_far_owned = false;
  // Set by the engine just before apply: its saved tensors are released
  // after it (the backward does not retain the graph), so apply may let go
  // of one as soon as it has read it (a product's input, before its
  // gradient of the same size is made).
  bool saved_released_after = false;
};

// Grad mode: when off (NoGradGuard), operators record nothing.
bool grad_enabled();
// Whether this thread is running a backward pass. Tensors saved then (by a
// segment recomputed inside it, recompute.h) are used by the same backward
// moments later: the spill manager does not copy them out ahead.
bool in_backward();
// The name of the node whose backward this thread is running ("" outside
// backward): what a traced step's debug log says made its peak
// (step_graph.h).
const char* backward_node_running();
class NoGradGuard {
 public:
  NoGradGuard();
  ~NoGradGuard();

 private:
  bool previous_;
};
// Grad mode on inside its scope (backward runs with it off; a segment of
// the forward recomputed there records its graph again, recompute.h).
class EnableGradGuard {
 public:
  EnableGradGuard();
  ~EnableGradGuard();

 private:
  bool previous_;
};
// Whether outputs made now are never read, only differentiated: the tail
// of a segment recomputed in backward (recompute.h), whose output only
// roots the graph that backward runs through. Operators whose backward
// does not read their output (a product without a fused ReLU, dropout)
// then record it as ever but leave its memory unwritten; an operator
// made of others whose outputs it reads runs those under a guard of
// false.
bool outputs_unread();
// outputs_unread() is `unread` inside its scope.
class OutputsUnreadGuard {
 public:
  explicit OutputsUnreadGuard(bool unread);
  ~OutputsUnreadGuard();
  OutputsUnreadGuard(const OutputsUnreadGuard&) = delete;
  OutputsUnreadGuard& operator=(const OutputsUnreadGuard&) = delete;

 private:
  bool previous_;
};

// How saved tensors are kept. pack() is called when a tensor is saved during
// forward; unpack() when backward needs it, and must return a tensor equal to
// the one packed.
class SavedTensorHooks {
 public:
  virtual ~SavedTensorHooks() = default;
  virtual std::any pack(const Tensor& t) = 0;
  virtual Tensor unpack(const std::any& packed) = 0;
};
// Installs hooks for tensors saved on this thread while it lives.
class SavedTensorHooksGuard {
 public:
  explicit SavedTensorHooksGuard(std::shared_ptr<SavedTensorHooks> hooks);
  ~SavedTensorHooksGuard();

 private:
  std::shared_ptr<SavedTensorHooks> previous_;
};

// Called on the thread running backward as soon as a gradient has been
// accumulated into a leaf's .grad, so that work on it (a data-parallel
// job's all-reduce, agent/gradient_reducer.h) starts while the rest of
// backward runs.
using GradientReadyHook = std::function<void(const Tensor& leaf)>;
// Installs `hook` for backward passes run on this thread while it lives.
class GradientReadyGuard {
 public:
  explicit GradientReadyGuard(GradientReadyHook hook);
  ~GradientReadyGuard();
  GradientReadyGuard(const GradientReadyGuard&) = delete;
  GradientReadyGuard& operator=(const GradientReadyGuard&) = delete;

 private:
  GradientReadyHook previous_;
};

// A tensor kept for backward (detached, so the graph has no cycles).
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& t);
  // Throws std::runtime_error when released (backward already ran without
  // retain_graph).
  Tensor get() const;
  void reset();

 private:
  Tensor tensor_;
  std::any packed_;
  std::shared_ptr<SavedTensorHooks> hooks_;
  bool saved_ = false;
};

// True when grad mode is on and any of `inputs` requires grad.
bool any_requires_grad(std::initializer_list<const Tensor*> inputs);
// Connects `node` to the inputs' gradient edges and makes it `out`'s grad_fn.
void record(Tensor& out, std::shared_ptr<Node> node, std::initializer_list<const Tensor*> inputs);

void run_backward(const Tensor& root, const Tensor& gradient, bool retain_graph);

// For a node whose backward, running, sends its part of a leaf's gradient
// to `edge_fn` (the leaf's accumulator): the leaf's gradient so far, where
// the node may add its part to it in place (the product that makes it
// adding it as it writes) and send that tensor on as its gradient for the
// leaf, which the accumulator then takes as summed. Only where it is this
// backward's only part for the leaf (no other node sends one), and the
// gradient is defined, of `sizes` and `dtype`, contiguous and held by the
// leaf alone; else undefined. A recomputed MLP in slices sums its
// weights' gradients so (recompute.h), where a pass of its own over each
// would follow each slice's product.
Tensor gradient_to_add_into(const std::shared_ptr<Node>& edge_fn, const Shape& sizes,
                            DType dtype);
// The same from `root_fn`, the node that made a root of the gradient's
// shape whose memory its caller let go first (a recomputed segment's
// output, which nothing reads: recompute.h). Throws std::invalid_argument
// for a null node.
void run_backward_from(std::shared_ptr<Node> root_fn, const Tensor& gradient, bool retain_graph);
// The same, where `leaf` (a tensor that needs gradients, with no grad_fn)
// already has `leaf_sum` of its gradient from outside this graph: it
// starts as the leaf's sum so far, offered to the first operator to send
// the leaf its part (Node::fold_into_input0), so that the leaf's gradient
// is leaf_sum plus this graph's, in one pass where that operator can add
// it. A leaf the graph does not reach gets no gradient here (its caller
// still holds leaf_sum); one it reaches gets at least leaf_sum. For a
// recomputed segment's input, whose other consumers summed their part of
// its gradient before the segment's backward ran (recompute.h).
// `gradient` is let go once the root's node has run (a caller that moves
// its own in holds none after). `leaf_sum_writable`: the caller gives
// leaf_sum's memory up to the leaf's gradient (nothing reads it after but
// through that gradient), so the operator that takes it may write the
// gradient over it (Node::sum_so_far_owned) although the caller still
// refers to it, and the leaf takes that gradient as it is: a recomputed
// segment whose sum so far is its own, run whole or gathering its input's
// gradient slice by slice into that sum (recompute.cpp).
void run_backward_from(std::shared_ptr<Node> root_fn, Tensor gradient, bool retain_graph,
                       const Tensor& leaf, const Tensor& leaf_sum,
                       bool leaf_sum_writable = false);

}  // namespace leasehold::engine
