// Elementwise operators and their gradients, each kernel looked up in a
// KernelTable by the tensors' device. Binary operators broadcast;
// their gradients are summed back to each input's shape (sum_to).
#include <stdexcept>

#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/elementwise.h"

namespace leasehold::engine {

using kernels::BinaryOp;
using kernels::UnaryOp;

namespace {

template <class T>
const auto kUnary = LEASEHOLD_KERNEL_TABLE("unary", unary, T);
template <class T>
const auto kBinary = LEASEHOLD_KERNEL_TABLE("binary", binary, T);

// Raw kernel calls (no autograd).
Tensor unary_raw(UnaryOp op, const Tensor& x, double s, const char* name) {
  detail::check_defined(x, name, "input");
  Tensor out = empty(x.sizes(), x.options());
  auto iv = detail::strided_of(x);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    kUnary<T>.run(x.device(), op, T(s), out.data<T>(), x.data<T>(), iv, x.numel());
  };
  if (op == UnaryOp::Identity || op == UnaryOp::Neg || op == UnaryOp::MulScalar ||
      op == UnaryOp::AddScalar || op == UnaryOp::GtScalar) {
    detail::dispatch_all(x.dtype(), run);
  } else {
    detail::dispatch_floating(x.dtype(), name, run);
  }
  return out;
}

Tensor binary_raw(BinaryOp op, const Tensor& a, const Tensor& b, double s, const char* name) {
  detail::check_same(a, b, name);
  Shape shape = broadcast_shapes(a.sizes(), b.sizes(), name);
  Tensor out = empty(shape, a.options());
  auto av = detail::broadcast_strided(a, shape), bv = detail::broadcast_strided(b, shape);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    kBinary<T>.run(a.device(), op, T(s), out.data<T>(), a.data<T>(), av, b.data<T>(), bv,
                   out.numel());
  };
  if (op == BinaryOp::Add || op == BinaryOp::Sub || op == BinaryOp::Mul || op == BinaryOp::Eq) {
    detail::dispatch_all(a.dtype(), run);
  } else {
    detail::dispatch_floating(a.dtype(), name, run);
  }
  return out;
}

// Backward nodes. `a`/`b` are inputs, `y` the output, as each needs.
struct AddBackward final : Node {
  Shape a_shape, b_shape;
  double b_sign = 1;  // -1 for sub
  const char* name() const override { return b_sign > 0 ? "AddBackward" : "SubBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor gb = sum_to(g, b_shape);
    return {sum_to(g, a_shape), b_sign > 0 ? gb : neg(gb)};
  }
};

struct MulBackward final : Node {
  SavedTensor a, b;
  Shape a_shape, b_shape;
  const char* name() const override { return "MulBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor ga = next[0].fn ? sum_to(mul(g, b.get()), a_shape) : Tensor();
    Tensor gb = next[1].fn ? sum_to(mul(g, a.get()), b_shape) : Tensor();
    return {ga, gb};
  }
  void release_saved() override { a.reset(); b.reset(); }
};

struct DivBackward final : Node {
  SavedTensor a, b;
  Shape a_shape, b_shape;
  const char* name() const override { return "DivBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor bv = b.get();
    Tensor ga = next[0].fn ? sum_to(div(g, bv), a_shape) : Tensor();
    Tensor gb;
    if (next[1].fn) gb = sum_to(neg(div(mul(g, a.get()), mul(bv, bv))), b_shape);
    return {ga, gb};
  }
  void release_saved() override { a.reset(); b.reset(); }
};

// y = f(x) with dy/dx computed by one fused binary kernel from g and a saved
// tensor (the input or the output).
struct UnaryBackward final : Node {
  const char* op_name;
  BinaryOp grad_op;
  double scalar = 0;
  SavedTensor saved;
  const char* name() const override { return op_name; }
  std::vector<Tensor> apply(const Tensor& g) override {
    return {binary_raw(grad_op, g, saved.get(), scalar, op_name)};
  }
  void release_saved() override { saved.reset(); }
};

struct ScaleBackward final : Node {
  double scale = 1;
  const char* name() const override { return "MulScalarBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    return {scale == 1 ? g : unary_raw(UnaryOp::MulScalar, g, scale, "mul")};
  }
};

Tensor unary_with_grad(UnaryOp op, const Tensor& x, double s, const char* name, BinaryOp grad_op,
                       bool save_output) {
  Tensor out = unary_raw(op, x, s, name);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<UnaryBackward>();
    node->op_name = name;
    node->grad_op = grad_op;
    node->scalar = s;
    node->saved = SavedTensor(save_output ? out : x);
    record(out, node, {&x});
  }
  return out;
}

Tensor scaled(const Tensor& x, UnaryOp op, double s, double grad_scale, const char* name) {
  Tensor out = unary_raw(op, x, s, name);
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<ScaleBackward>();
    node->scale = grad_scale;
    record(out, node, {&x});
  }
  return out;
}

Tensor add_sub(const Tensor& a, const Tensor& b, bool subtract) {
  const char* name = subtract ? "sub" : "add";
  Tensor out = binary_raw(subtract ? BinaryOp::Sub : BinaryOp::Add, a, b, 0, name);
  if (any_requires_grad({&a, &b})) {
    auto node = std::make_shared<AddBackward>();
    node->a_shape = a.sizes();
    node->b_shape = b.sizes();
    node->b_sign = subtract ? -1 : 1;
    record(out, node, {&a, &b});
  }
  return out;
}

}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1) {
      throw std::invalid_argument(std::string(op) + ": shapes " + shape_to_string(a) + " and " +
                                  shape_to_string(b) + " do not broadcast");
    }
    out[i] = da == 1 ? db : da;
  }
  return out;
}

Tensor sum_to(const Tensor& g, const Shape& shape) {
  if (g.sizes() == shape) return g;
  int64_t lead = g.dim() - static_cast<int64_t>(shape.size());
  if (lead < 0) {
    throw std::invalid_argument("sum_to: cannot reduce " + g.shape_str() + " to " +
                                shape_to_string(shape));
  }
  Shape dims;
  for (int64_t d = 0; d < g.dim(); ++d) {
    if (d < lead || (shape[d - lead] == 1 && g.size(d) != 1)) dims.push_back(d);
  }
  Tensor r = dims.empty() ? g : sum(g, dims, /*keepdim=*/true);
  return r.reshape(shape);
}

Tensor add(const Tensor& a, const Tensor& b) { return add_sub(a, b, false); }
Tensor sub(const Tensor& a, const Tensor& b) { return add_sub(a, b, true); }

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Mul, a, b, 0, "mul");
  if (any_requires_grad({&a, &b})) {
    auto node = std::make_shared<MulBackward>();
    node->a_shape = a.sizes();
    node->b_shape = b.sizes();
    if (b.requires_grad()) node->a = SavedTensor(a);
    if (a.requires_grad()) node->b = SavedTensor(b);
    record(out, node, {&a, &b});
  }
  return out;
}

Tensor div(const Tensor& a, const Tensor& b) {
  Tensor out = binary_raw(BinaryOp::Div, a, b, 0, "div");
  if (any_requires_grad({&a, &b})) {
    auto node = std::make_shared<DivBackward>();
    node->a_shape = a.sizes();
    node->b_shape = b.sizes();
    node->a = SavedTensor(a);
    node->b = SavedTensor(b);
    record(out, node, {&a, &b});
  }
  return out;
}

Tensor add(const Tensor& a, double s) { return scaled(a, UnaryOp::AddScalar, s, 1, "add"); }
Tensor mul(const Tensor& a, double s) { return scaled(a, UnaryOp::MulScalar, s, s, "mul"); }
Tensor neg(const Tensor& x) { return scaled(x, UnaryOp::Neg, 0, -1, "neg"); }

Tensor exp(const Tensor& x) {
  return unary_with_grad(UnaryOp::Exp, x, 0, "exp", BinaryOp::Mul, /*save_output=*/true);
}
Tensor log(const Tensor& x) {
  return unary_with_grad(UnaryOp::Log, x, 0, "log", BinaryOp::Div, false);
}
Tensor pow(const Tensor& x, double e) {
  return unary_with_grad(UnaryOp::PowScalar, x, e, "pow", BinaryOp::PowScalarGrad, false);
}
Tensor sqrt(const Tensor& x) { return pow(x, 0.5); }
Tensor relu(const Tensor& x) {
  // relu(x) > 0 exactly where x > 0, so the output serves backward: it is
  // usually what the next layer saves anyway (one tensor kept, not two).
  return unary_with_grad(UnaryOp::Relu, x, 0, "relu", BinaryOp::ReluGrad, /*save_output=*/true);
}
Tensor sigmoid(const Tensor& x) {
  return unary_with_grad(UnaryOp::Sigmoid, x, 0, "sigmoid", BinaryOp::SigmoidGrad, true);
}
Tensor tanh(const Tensor& x) {
  return unary_with_grad(UnaryOp::Tanh, x, 0, "tanh", BinaryOp::TanhGrad, true);
}
Tensor gelu(const Tensor& x) {
  return unary_with_grad(UnaryOp::Gelu, x, 0, "gelu", BinaryOp::GeluGrad, /*save_output=*/false);
}
Tensor abs(const Tensor& x) {
  // d|x|/dx = sign(x): g * sign(x).
  Tensor out = mul(x, unary_raw(UnaryOp::Sign, x, 0, "abs"));
  return out;
}
Tensor eq(const Tensor& a, const Tensor& b) { return binary_raw(BinaryOp::Eq, a, b, 0, "eq"); }

}  // namespace leasehold::engine
