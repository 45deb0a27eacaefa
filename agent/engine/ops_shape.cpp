// Views and copies: view/reshape, transpose/permute, narrow, expand,
// unsqueeze, flatten, contiguous, clone, detach. Views share storage; their
// backward maps the gradient back to the input's shape.
#include <numeric>
#include <stdexcept>

#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/ops.h"
#include "kernels/elementwise.h"

namespace leasehold::engine {
namespace {

int64_t wrap_dim(int64_t d, int64_t ndim, const char* op) {
  int64_t i = d < 0 ? d + ndim : d;
  if (i < 0 || i >= std::max<int64_t>(ndim, 1)) {
    throw std::invalid_argument(std::string(op) + ": dimension " + std::to_string(d) +
                                " out of range for " + std::to_string(ndim) + " dimensions");
  }
  return i;
}

Tensor make_view(const Tensor& base, Shape sizes, Shape strides, int64_t offset) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = base.impl()->storage;
  impl->sizes = std::move(sizes);
  impl->strides = std::move(strides);
  impl->offset = offset;
  impl->dtype = base.dtype();
  return Tensor(impl);
}

// Strides for viewing `t` as `shape` without copying, if possible: old
// dimensions are grouped into chunks that are contiguous with each other, and
// each chunk must map onto whole new dimensions.
std::optional<Shape> view_strides(const Tensor& t, const Shape& shape) {
  if (t.is_contiguous() || t.dim() == 0) return contiguous_strides(shape);
  const Shape& os = t.sizes();
  const Shape& ost = t.strides();
  Shape out(shape.size());
  int64_t view_d = static_cast<int64_t>(shape.size()) - 1;
  int64_t chunk_stride = ost.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(os.size()) - 1; d >= 0; --d) {
    tensor_numel *= os[d];
    bool chunk_ends = d == 0 || (os[d - 1] != 1 && ost[d - 1] != tensor_numel * chunk_stride);
    if (!chunk_ends) continue;
    while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
      out[view_d] = view_numel * chunk_stride;
      view_numel *= shape[view_d];
      --view_d;
    }
    if (view_numel != tensor_numel) return std::nullopt;
    if (d > 0) {
      chunk_stride = ost[d - 1];
      tensor_numel = 1;
      view_numel = 1;
    }
  }
  if (view_d != -1) return std::nullopt;
  return out;
}

Shape infer_shape(Shape shape, int64_t numel, const char* op, const Shape& from) {
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == -1) {
      if (infer >= 0) throw std::invalid_argument(std::string(op) + ": only one -1 allowed");
      infer = static_cast<int64_t>(i);
    } else if (shape[i] < 0) {
      throw std::invalid_argument(std::string(op) + ": negative size in " +
                                  shape_to_string(shape));
    } else {
      known *= shape[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || numel % known != 0) {
      throw std::invalid_argument(std::string(op) + ": cannot view " + shape_to_string(from) +
                                  " as " + shape_to_string(shape));
    }
    shape[infer] = numel / known;
  }
  if (numel_of(shape) != numel) {
    throw std::invalid_argument(std::string(op) + ": shape " + shape_to_string(shape) +
                                " has a different number of elements than " +
                                shape_to_string(from));
  }
  return shape;
}

struct ReshapeBackward final : Node {
  Shape input_shape;
  const char* name() const override { return "ReshapeBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override { return {g.reshape(input_shape)}; }
};

struct PermuteBackward final : Node {
  Shape inverse;
  const char* name() const override { return "PermuteBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override { return {g.permute(inverse)}; }
};

struct NarrowBackward final : Node {
  Shape input_shape;
  int64_t dim = 0, start = 0;
  const char* name() const override { return "NarrowBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor full_grad = zeros(input_shape, g.options());
    full_grad.narrow(dim, start, g.size(dim)).copy_(g);
    return {full_grad};
  }
};

struct ExpandBackward final : Node {
  Shape input_shape;
  const char* name() const override { return "ExpandBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override { return {sum_to(g, input_shape)}; }
};

struct IdentityBackward final : Node {
  const char* name() const override { return "CloneBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override { return {g}; }
};

}  // namespace

Tensor Tensor::detach() const {
  Tensor out = make_view(*this, sizes(), strides(), storage_offset());
  return out;
}

Tensor Tensor::view(Shape shape) const {
  shape = infer_shape(std::move(shape), numel(), "view", sizes());
  auto st = view_strides(*this, shape);
  if (!st) {
    throw std::invalid_argument("view: cannot view a non-contiguous " + shape_str() + " as " +
                                shape_to_string(shape) + " (use reshape())");
  }
  Tensor out = make_view(*this, shape, *st, storage_offset());
  if (any_requires_grad({this})) {
    auto node = std::make_shared<ReshapeBackward>();
    node->input_shape = sizes();
    record(out, node, {this});
  }
  return out;
}

Tensor Tensor::reshape(Shape shape) const {
  shape = infer_shape(std::move(shape), numel(), "reshape", sizes());
  if (view_strides(*this, shape)) return view(shape);
  return contiguous().view(shape);
}

Tensor Tensor::permute(Shape dims) const {
  int64_t n = dim();
  if (static_cast<int64_t>(dims.size()) != n) {
    throw std::invalid_argument("permute: " + std::to_string(dims.size()) + " dimensions for a " +
                                std::to_string(n) + "-d tensor");
  }
  Shape sizes_out(n), strides_out(n), inverse(n);
  std::vector<bool> used(n, false);
  for (int64_t i = 0; i < n; ++i) {
    int64_t d = wrap_dim(dims[i], n, "permute");
    if (used[d]) throw std::invalid_argument("permute: repeated dimension " + std::to_string(d));
    used[d] = true;
    sizes_out[i] = sizes()[d];
    strides_out[i] = strides()[d];
    inverse[d] = i;
  }
  Tensor out = make_view(*this, sizes_out, strides_out, storage_offset());
  if (any_requires_grad({this})) {
    auto node = std::make_shared<PermuteBackward>();
    node->inverse = inverse;
    record(out, node, {this});
  }
  return out;
}

Tensor Tensor::transpose(int64_t d0, int64_t d1) const {
  Shape perm(dim());
  std::iota(perm.begin(), perm.end(), 0);
  std::swap(perm[wrap_dim(d0, dim(), "transpose")], perm[wrap_dim(d1, dim(), "transpose")]);
  return permute(perm);
}

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
  d = wrap_dim(d, dim(), "narrow");
  if (start < 0 || length < 0 || start + length > sizes()[d]) {
    throw std::invalid_argument("narrow: range [" + std::to_string(start) + ", " +
                                std::to_string(start + length) + ") outside dimension " +
                                std::to_string(d) + " of size " + std::to_string(sizes()[d]));
  }
  Shape s = sizes();
  s[d] = length;
  Tensor out = make_view(*this, s, strides(), storage_offset() + start * strides()[d]);
  if (any_requires_grad({this})) {
    auto node = std::make_shared<NarrowBackward>();
    node->input_shape = sizes();
    node->dim = d;
    node->start = start;
    record(out, node, {this});
  }
  return out;
}

Tensor Tensor::expand(Shape shape) const {
  if (static_cast<int64_t>(shape.size()) < dim()) {
    throw std::invalid_argument("expand: cannot expand " + shape_str() + " to fewer dimensions " +
                                shape_to_string(shape));
  }
  int64_t lead = static_cast<int64_t>(shape.size()) - dim();
  Shape st(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) {
    int64_t td = static_cast<int64_t>(i) - lead;
    if (td < 0) {
      st[i] = 0;
    } else if (sizes()[td] == shape[i]) {
      st[i] = strides()[td];
    } else if (sizes()[td] == 1) {
      st[i] = 0;
    } else {
      throw std::invalid_argument("expand: cannot expand " + shape_str() + " to " +
                                  shape_to_string(shape));
    }
  }
  Tensor out = make_view(*this, shape, st, storage_offset());
  if (any_requires_grad({this})) {
    auto node = std::make_shared<ExpandBackward>();
    node->input_shape = sizes();
    record(out, node, {this});
  }
  return out;
}

Tensor Tensor::unsqueeze(int64_t d) const {
  int64_t n = dim();
  int64_t i = d < 0 ? d + n + 1 : d;
  if (i < 0 || i > n) throw std::invalid_argument("unsqueeze: dimension out of range");
  Shape s = sizes();
  s.insert(s.begin() + i, 1);
  return reshape(s);
}

Tensor Tensor::flatten(int64_t start_dim, int64_t end_dim) const {
  if (dim() == 0) return reshape({1});
  int64_t s = wrap_dim(start_dim, dim(), "flatten"), e = wrap_dim(end_dim, dim(), "flatten");
  if (s > e) throw std::invalid_argument("flatten: start_dim after end_dim");
  Shape out(sizes().begin(), sizes().begin() + s);
  int64_t prod = 1;
  for (int64_t i = s; i <= e; ++i) prod *= sizes()[i];
  out.push_back(prod);
  out.insert(out.end(), sizes().begin() + e + 1, sizes().end());
  return reshape(out);
}

Tensor Tensor::clone() const {
  Tensor out = empty(sizes(), options());
  {
    NoGradGuard no_grad;
    out.copy_(*this);
  }
  if (any_requires_grad({this})) record(out, std::make_shared<IdentityBackward>(), {this});
  return out;
}

Tensor Tensor::contiguous() const { return is_contiguous() ? *this : clone(); }

}  // namespace leasehold::engine
