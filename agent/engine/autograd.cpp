#include "agent/engine/autograd.h"

#include <stdexcept>
#include <unordered_map>

#include "agent/engine/ops.h"

namespace leasehold::engine {
namespace {

// a + b for two gradients of one tensor: bfloat16 ones (autocast's
// activations between products) summed in float32, then rounded once.
Tensor accumulate(const Tensor& a, const Tensor& b) {
  if (a.dtype() != DType::BFloat16) return add(a, b);
  return add(a.to(DType::Float32), b.to(DType::Float32)).to(DType::BFloat16);
}

thread_local bool t_grad_enabled = true;
thread_local bool t_outputs_unread = false;
thread_local int t_backward_depth = 0;  // backward passes running (recomputing nests them)
thread_local const char* t_node_running = "";  // backward_node_running()
thread_local std::shared_ptr<SavedTensorHooks> t_hooks;
thread_local GradientReadyHook t_gradient_ready;
// The running backward's edge counts and gradients so far, per node
// (gradient_to_add_into); the innermost one's where backward nests.
struct BackwardState {
  const std::unordered_map<Node*, int>* deps = nullptr;
  const std::unordered_map<Node*, Tensor>* buffers = nullptr;
  // The leaf whose sum so far its caller gave up (run_backward_from's
  // leaf_sum_writable), and that sum's memory, which its gradient may be.
  const TensorImpl* given_sum_leaf = nullptr;
  const Storage* given_sum = nullptr;
  uint64_t id = 0;  // which backward (one counter a thread)
};
thread_local BackwardState t_backward;
thread_local uint64_t t_backward_ids = 0;

// Adds a gradient into a leaf's .grad.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(std::shared_ptr<TensorImpl> leaf) : leaf_(std::move(leaf)) {}
  const char* name() const override { return "AccumulateGrad"; }
  bool saves_tensors() const override { return false; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor leaf(leaf_);
    Tensor incoming = g;
    if (incoming.sizes() != leaf.sizes()) incoming = sum_to(incoming, leaf.sizes());
    // (Summed in place by the node that sent it, in this backward: what
    // gradient_to_add_into handed out, come back. The leaf's gradient may
    // have been replaced meanwhile by a sum that includes it.)
    const bool summed =
        added_in_backward_ == t_backward.id && added_in_place_.lock() == incoming.impl();
    added_in_place_.reset();
    added_in_backward_ = 0;
    if (!summed) {
      if (!leaf.grad().defined()) {
        // Adopt the buffer when nothing else references it; else copy, so
        // that two leaves never share one gradient buffer. (A leaf whose
        // sum so far was given up takes its gradient written over that
        // sum, whose memory its caller gathers into: recompute.cpp.)
        const bool given = leaf_.get() == t_backward.given_sum_leaf &&
                           incoming.is_contiguous() &&
                           incoming.impl()->storage.get() == t_backward.given_sum;
        const bool sole =
            given || (incoming.impl().use_count() <= 2 && incoming.is_contiguous() &&
                      incoming.impl()->storage.use_count() == 1);
        leaf.set_grad(sole ? incoming.detach() : incoming.clone().detach());
      } else {
        leaf.set_grad(accumulate(leaf.grad(), incoming).detach());
      }
    }
    if (t_gradient_ready) t_gradient_ready(leaf);
    return {};
  }
  Tensor leaf() const { return Tensor(leaf_); }
  // gradient_to_add_into handed `g` out in the running backward.
  void added_in_place(const Tensor& g) {
    added_in_place_ = g.impl();
    added_in_backward_ = t_backward.id;
  }

 private:
  std::shared_ptr<TensorImpl> leaf_;
  std::weak_ptr<TensorImpl> added_in_place_;
  uint64_t added_in_backward_ = 0;
};

Edge gradient_edge(const Tensor& t) {
  if (t.grad_fn()) return {t.grad_fn()};
  if (!t.impl()->requires_grad) return {};
  std::shared_ptr<Node> acc = t.impl()->grad_accumulator.lock();
  if (!acc) {
    acc = std::make_shared<AccumulateGrad>(t.impl());
    t.impl()->grad_accumulator = acc;
  }
  return {acc};
}

// Names the node whose backward runs in its scope (backward_node_running);
// the outer one's again after (a recomputed segment's backward nests).
class NodeRunning {
 public:
  explicit NodeRunning(const char* name) : outer_(t_node_running) { t_node_running = name; }
  ~NodeRunning() { t_node_running = outer_; }
  NodeRunning(const NodeRunning&) = delete;
  NodeRunning& operator=(const NodeRunning&) = delete;

 private:
  const char* outer_;
};

}  // namespace

Tensor gradient_to_add_into(const std::shared_ptr<Node>& edge_fn, const Shape& sizes,
                            DType dtype) {
  auto* acc = dynamic_cast<AccumulateGrad*>(edge_fn.get());
  if (!acc || !t_backward.deps) return Tensor();
  // (This backward's only part for the leaf: one edge to it, and nothing
  // summed for it yet. Another part would be added to the sum after.)
  const auto d = t_backward.deps->find(edge_fn.get());
  if (d == t_backward.deps->end() || d->second != 1 || t_backward.buffers->count(edge_fn.get())) {
    return Tensor();
  }
  Tensor g = acc->leaf().grad();
  // (Held by the leaf alone: its slot and this handle.)
  if (!g.defined() || g.sizes() != sizes || g.dtype() != dtype || !g.is_contiguous() ||
      g.impl().use_count() != 2 || !g.impl()->storage || g.impl()->storage.use_count() != 1) {
    return Tensor();
  }
  acc->added_in_place(g);
  return g;
}

bool grad_enabled() { return t_grad_enabled; }
bool in_backward() { return t_backward_depth > 0; }
const char* backward_node_running() { return t_node_running; }
bool outputs_unread() { return t_outputs_unread; }
OutputsUnreadGuard::OutputsUnreadGuard(bool unread) : previous_(t_outputs_unread) {
  t_outputs_unread = unread;
}
OutputsUnreadGuard::~OutputsUnreadGuard() { t_outputs_unread = previous_; }
NoGradGuard::NoGradGuard() : previous_(t_grad_enabled) { t_grad_enabled = false; }
NoGradGuard::~NoGradGuard() { t_grad_enabled = previous_; }
EnableGradGuard::EnableGradGuard() : previous_(t_grad_enabled) { t_grad_enabled = true; }
EnableGradGuard::~EnableGradGuard() { t_grad_enabled = previous_; }

SavedTensorHooksGuard::SavedTensorHooksGuard(std::shared_ptr<SavedTensorHooks> hooks)
    : previous_(std::move(t_hooks)) {
  t_hooks = std::move(hooks);
}
GradientReadyGuard::GradientReadyGuard(GradientReadyHook hook)
    : previous_(std::move(t_gradient_ready)) {
  t_gradient_ready = std::move(hook);
}
GradientReadyGuard::~GradientReadyGuard() { t_gradient_ready = std::move(previous_); }

SavedTensorHooksGuard::~SavedTensorHooksGuard() { t_hooks = std::move(previous_); }

SavedTensor::SavedTensor(const Tensor& t) : saved_(true) {
  if (!t.defined()) return;
  Tensor detached = t.detach();
  if (t_hooks) {
    hooks_ = t_hooks;
    packed_ = hooks_->pack(detached);
  } else {
    tensor_ = detached;
  }
}

Tensor SavedTensor::get() const {
  if (!saved_) {
    throw std::runtime_error(
        "trying to backward through the graph a second time (or to use saved tensors after "
        "they were freed); call backward(gradient, /*retain_graph=*/true) the first time");
  }
  if (hooks_) return hooks_->unpack(packed_);
  return tensor_;
}

void SavedTensor::reset() {
  tensor_ = Tensor();
  packed_.reset();
  hooks_.reset();
  saved_ = false;
}

bool any_requires_grad(std::initializer_list<const Tensor*> inputs) {
  if (!t_grad_enabled) return false;
  for (const Tensor* t : inputs) {
    if (t && t->defined() && t->requires_grad()) return true;
  }
  return false;
}

void record(Tensor& out, std::shared_ptr<Node> node, std::initializer_list<const Tensor*> inputs) {
  for (const Tensor* t : inputs) {
    node->next.push_back(t && t->defined() ? gradient_edge(*t) : Edge{});
  }
  out.impl()->grad_fn = std::move(node);
}

void run_backward(const Tensor& root, const Tensor& gradient, bool retain_graph) {
  if (!root.defined()) throw std::invalid_argument("backward of an undefined tensor");
  if (!root.requires_grad()) {
    throw std::invalid_argument(
        "backward: the tensor does not require grad and has no grad_fn (nothing it depends on "
        "requires grad)");
  }
  Tensor grad = gradient;
  if (!grad.defined()) {
    if (root.numel() != 1) {
      throw std::invalid_argument("backward: grad can be implicitly created only for scalar "
                                  "outputs; pass a gradient of shape " + root.shape_str());
    }
    grad = ones(root.sizes(), root.options());
  } else if (grad.sizes() != root.sizes()) {
    throw std::invalid_argument("backward: gradient of shape " + grad.shape_str() +
                                " for a tensor of shape " + root.shape_str());
  }

  run_backward_from(gradient_edge(root).fn, grad, retain_graph);
}

void run_backward_from(std::shared_ptr<Node> root_fn, const Tensor& grad, bool retain_graph) {
  run_backward_from(std::move(root_fn), grad, retain_graph, Tensor(), Tensor());
}

void run_backward_from(std::shared_ptr<Node> root_fn, Tensor grad, bool retain_graph,
                       const Tensor& leaf, const Tensor& leaf_sum, bool leaf_sum_writable) {
  if (!root_fn) throw std::invalid_argument("backward from no node");
  const Edge start{std::move(root_fn)};
  // Dependencies: how many edges point at each node from nodes we will run.
  std::unordered_map<Node*, int> deps;
  std::vector<Node*> stack{start.fn.get()};
  std::unordered_map<Node*, bool> seen{{start.fn.get(), true}};
  while (!stack.empty()) {
    Node* n = stack.back();
    stack.pop_back();
    for (const Edge& e : n->next) {
      if (!e.fn) continue;
      ++deps[e.fn.get()];
      if (!seen[e.fn.get()]) {
        seen[e.fn.get()] = true;
        stack.push_back(e.fn.get());
      }
    }
  }

  NoGradGuard no_grad;
  struct Depth {
    Depth() { ++t_backward_depth; }
    ~Depth() { --t_backward_depth; }
  } depth;
  std::unordered_map<Node*, Tensor> buffers;
  struct Running {
    BackwardState outer = t_backward;
    Running(const std::unordered_map<Node*, int>& d, const std::unordered_map<Node*, Tensor>& b,
            const Tensor& leaf, const Tensor& given_sum) {
      t_backward = {&d, &b};
      t_backward.id = ++t_backward_ids;
      if (leaf.defined() && given_sum.defined()) {
        t_backward.given_sum_leaf = leaf.impl().get();
        t_backward.given_sum = given_sum.impl()->storage.get();
      }
    }
    ~Running() { t_backward = outer; }
  } running(deps, buffers, leaf, leaf_sum_writable ? leaf_sum : Tensor());
  buffers.emplace(start.fn.get(), std::move(grad));
  // (Only where the graph reaches the leaf: one it does not reach would
  // keep the sum in a buffer no node takes.)
  if (leaf_sum.defined() && leaf.defined() && !leaf.grad_fn()) {
    const Edge edge = gradient_edge(leaf);
    if (edge.fn && deps.count(edge.fn.get()) && edge.fn != start.fn) {
      buffers[edge.fn.get()] = leaf_sum;
    }
  }
  std::vector<std::shared_ptr<Node>> ready{start.fn};
  while (!ready.empty()) {
    std::shared_ptr<Node> node = std::move(ready.back());
    ready.pop_back();
    auto it = buffers.find(node.get());
    Tensor g = it != buffers.end() ? it->second : Tensor();
    if (it != buffers.end()) buffers.erase(it);
    std::vector<Tensor> grads;
    bool folded = false;  // grads[0] includes input 0's sum so far
    if (g.defined()) {
      if (node->released) {
        throw std::runtime_error(
            std::string("trying to backward through the graph a second time (") + node->name() +
            "'s saved tensors were freed); pass retain_graph=true to the first backward");
      }
      node->sum_so_far_owned = false;
      if (!node->next.empty() && node->next[0].fn) {
        auto sum = buffers.find(node->next[0].fn.get());
        if (sum != buffers.end() && sum->second.defined()) {
          const Tensor& s = sum->second;
          // (Only the buffer holds it, checked before the node takes it;
          // or it is the leaf's sum so far as it came, which the caller
          // gave up.)
          const bool owned =
              (leaf_sum_writable && s.impl() == leaf_sum.impl()) ||
              (s.impl().use_count() == 1 && s.impl()->storage && s.impl()->storage.use_count() == 1);
          folded = node->fold_into_input0(s);
          node->sum_so_far_owned = folded && owned;
        }
      }
      // (Only `g` holds its tensor and its memory: no sibling's gradient
      // or saved tensor shares it.)
      node->grad_output_owned =
          g.impl().use_count() == 1 && g.impl()->storage && g.impl()->storage.use_count() == 1;
      node->saved_released_after = !retain_graph && node->saves_tensors();
      {
        NodeRunning running(node->name());
        grads = node->apply_taking(std::move(g));
      }
      if (!retain_graph && node->saves_tensors()) {
        node->release_saved();
        node->released = true;
      }
    }
    for (size_t i = 0; i < node->next.size(); ++i) {
      const Edge& e = node->next[i];
      if (!e.fn) continue;
      if (i < grads.size() && grads[i].defined()) {
        Tensor& slot = buffers[e.fn.get()];
        slot = slot.defined() && !(i == 0 && folded) ? accumulate(slot, grads[i]) : grads[i];
      }
      if (--deps[e.fn.get()] == 0) ready.push_back(e.fn);
    }
  }
}

}  // namespace leasehold::engine
