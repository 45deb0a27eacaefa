// Reductions (sum, mean, max/argmax), softmax/log_softmax and losses. A
// reduction permutes the reduced dimensions to the end, makes the tensor
// contiguous and runs a row kernel over [outer, inner]; on CUDA a sum over
// the leading dimensions runs a column kernel instead.
#include <algorithm>
#include <numeric>
#include <stdexcept>

#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/reduce.h"

namespace leasehold::engine {
namespace {

template <class T>
const auto kSumRows = LEASEHOLD_KERNEL_TABLE("sum", sum_rows, T);
template <class T>
const auto kMaxRows = LEASEHOLD_KERNEL_TABLE("max", max_rows, T);
template <class T>
const auto kScatterRows = LEASEHOLD_KERNEL_TABLE("max", scatter_rows, T);
template <class T>
const auto kSoftmax = LEASEHOLD_KERNEL_TABLE("softmax", softmax_rows, T);
template <class T>
const auto kSoftmaxBackward = LEASEHOLD_KERNEL_TABLE("softmax", softmax_backward_rows, T);
template <class T>
const auto kCrossEntropy = LEASEHOLD_KERNEL_TABLE("cross_entropy", cross_entropy_rows, T);
template <class T>
const auto kCrossEntropyBackward =
    LEASEHOLD_KERNEL_TABLE("cross_entropy", cross_entropy_backward_rows, T);

struct Rows {
  Tensor data;        // contiguous [outer, inner] (as laid out in memory)
  int64_t outer = 1, inner = 1;
  Shape kept_shape;   // sizes of the kept dimensions
  Shape keepdim_shape;
};

Shape normalize_dims(const Shape& dims, int64_t ndim, const char* op) {
  Shape out;
  if (dims.empty()) {
    out.resize(ndim);
    std::iota(out.begin(), out.end(), 0);
    return out;
  }
  for (int64_t d : dims) {
    int64_t i = d < 0 ? d + ndim : d;
    if (i < 0 || i >= ndim) {
      throw std::invalid_argument(std::string(op) + ": dimension " + std::to_string(d) +
                                  " out of range for " + std::to_string(ndim) + " dimensions");
    }
    if (std::find(out.begin(), out.end(), i) != out.end()) {
      throw std::invalid_argument(std::string(op) + ": dimension " + std::to_string(d) +
                                  " repeated");
    }
    out.push_back(i);
  }
  std::sort(out.begin(), out.end());
  return out;
}

Rows to_rows(const Tensor& x, const Shape& reduced) {
  Rows r;
  Shape perm;
  r.keepdim_shape = x.sizes();
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (!std::binary_search(reduced.begin(), reduced.end(), d)) {
      perm.push_back(d);
      r.kept_shape.push_back(x.size(d));
      r.outer *= x.size(d);
    }
  }
  for (int64_t d : reduced) {
    perm.push_back(d);
    r.inner *= x.size(d);
    r.keepdim_shape[d] = 1;
  }
  NoGradGuard no_grad;
  r.data = x.permute(perm).contiguous();
  return r;
}

// Sums over the leading dimensions of a contiguous CUDA tensor (a batch's
// bias gradient, a mean loss), times `scale`, as column sums without the
// transposing copy; undefined when the reduction is not of that kind.
Tensor sum_leading(const Tensor& x, const Shape& dims, bool keepdim, double scale) {
#ifdef LEASEHOLD_HAVE_CUDA
  // dims is sorted and unique: a prefix exactly when its last is its size - 1.
  const int64_t k = static_cast<int64_t>(dims.size());
  if (!x.device().is_cuda() || !x.is_contiguous() || k == 0 || dims.back() != k - 1) {
    return Tensor();
  }
  int64_t rows = 1, columns = 1;
  Shape kept, keepdim_shape = x.sizes();
  for (int64_t d = 0; d < x.dim(); ++d) {
    if (d < k) {
      rows *= x.size(d);
      keepdim_shape[d] = 1;
    } else {
      columns *= x.size(d);
      kept.push_back(x.size(d));
    }
  }
  Tensor out = empty(keepdim ? keepdim_shape : kept, x.options());
  // Many rows: partial sums of kPartRows rows each (more blocks at work),
  // then the partial sums', in order (the same bits every run).
  constexpr int64_t kPartRows = 256;
  const int64_t parts = (rows + kPartRows - 1) / kPartRows;
  // (A full sum, or a few columns, of many rows is a row sum's work: one
  // column of 32 lanes would leave 31 idle.)
  if (rows > kernels::kMaxColumnRows && (parts > kernels::kMaxColumnRows || columns < 32)) {
    return Tensor();
  }
  Tensor partial = rows > kernels::kMaxColumnRows ? empty({parts, columns}, x.options()) : Tensor();
  detail::dispatch_all(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    const kernels::Stream stream = stream_for(x.device());
    if (partial.defined()) {
      kernels::cuda::sum_columns<T>(stream, {.out = partial.data<T>(),
                                             .in = x.data<T>(),
                                             .rows = rows,
                                             .columns = columns,
                                             .part_rows = kPartRows});
    }
    const kernels::ColumnSums<T> s{.out = out.data<T>(),
                                   .in = partial.defined() ? partial.data<T>() : x.data<T>(),
                                   .rows = partial.defined() ? parts : rows,
                                   .columns = columns,
                                   .scale = static_cast<T>(scale)};
    kernels::cuda::sum_columns<T>(stream, s);
  });
  return out;
#else
  (void)x, (void)dims, (void)keepdim, (void)scale;
  return Tensor();
#endif
}

Tensor sum_raw(const Tensor& x, const Shape& dims, bool keepdim) {
  Rows r = to_rows(x, dims);
  Tensor out = empty(keepdim ? r.keepdim_shape : r.kept_shape, x.options());
  // Scratch for long rows from the current allocator (a job's leases).
  Tensor scratch;
  if (int64_t n = kernels::sum_rows_scratch(r.outer, r.inner)) {
    scratch = empty({n}, x.options());
  }
  detail::dispatch_all(x.dtype(), [&](auto tag) {
    using T = decltype(tag);
    kSumRows<T>.run(x.device(), out.data<T>(), r.data.data<T>(), r.outer, r.inner,
                    scratch.defined() ? scratch.data<T>() : nullptr);
  });
  return out;
}

struct SumBackward final : Node {
  Shape input_shape, keepdim_shape;
  double scale = 1;  // 1/count for mean
  const char* name() const override { return scale == 1 ? "SumBackward" : "MeanBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor e = g.reshape(keepdim_shape).expand(input_shape).contiguous();
    return {scale == 1 ? e : mul(e, scale)};
  }
};

Tensor reduce(const Tensor& x, Shape dims, bool keepdim, bool is_mean) {
  const char* name = is_mean ? "mean" : "sum";
  detail::check_defined(x, name, "input");
  dims = normalize_dims(dims, x.dim(), name);
  int64_t count = 1;
  for (int64_t d : dims) count *= x.size(d);
  double scale = is_mean ? 1.0 / std::max<int64_t>(count, 1) : 1.0;
  if (is_mean && !is_floating(x.dtype())) {
    throw std::invalid_argument("mean: needs a floating tensor");
  }
  Tensor out = sum_leading(x, dims, keepdim, scale);
  if (!out.defined()) {
    out = sum_raw(x, dims, keepdim);
    if (is_mean) {
      NoGradGuard no_grad;
      out = mul(out, scale);
    }
  }
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<SumBackward>();
    node->input_shape = x.sizes();
    Shape kd = x.sizes();
    for (int64_t d : dims) kd[d] = 1;
    node->keepdim_shape = kd;
    node->scale = scale;
    record(out, node, {&x});
  }
  return out;
}

struct MaxBackward final : Node {
  SavedTensor indices;  // [outer]
  Shape input_shape, perm_inverse, permuted_shape;
  int64_t outer = 1, inner = 1;
  const char* name() const override { return "MaxBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor gc = g.contiguous();
    Tensor grad_rows = zeros(permuted_shape, g.options());
    Tensor idx = indices.get();
    detail::dispatch_floating(g.dtype(), "max backward", [&](auto tag) {
      using T = decltype(tag);
      kScatterRows<T>.run(g.device(), grad_rows.data<T>(), idx.data<int64_t>(), gc.data<T>(),
                          outer, inner);
    });
    return {grad_rows.permute(perm_inverse).contiguous()};
  }
  void release_saved() override { indices.reset(); }
};

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log);

struct SoftmaxBackward final : Node {
  SavedTensor y;  // output, in the layout given to the kernel
  int64_t dim = -1;
  bool log = false;
  const char* name() const override { return log ? "LogSoftmaxBackward" : "SoftmaxBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor yv = y.get();
    int64_t nd = yv.dim();
    Tensor gl = g.transpose(dim, nd - 1).contiguous();
    Tensor yl = yv.transpose(dim, nd - 1).contiguous();
    int64_t inner = nd ? yl.size(-1) : 1;
    int64_t outer = yl.numel() / std::max<int64_t>(inner, 1);
    Tensor gin = empty(yl.sizes(), yl.options());
    detail::dispatch_floating(g.dtype(), "softmax backward", [&](auto tag) {
      using T = decltype(tag);
      kSoftmaxBackward<T>.run(g.device(), gin.data<T>(), gl.data<T>(), yl.data<T>(), outer,
                              inner, log);
    });
    return {gin.transpose(dim, nd - 1).contiguous()};
  }
  void release_saved() override { y.reset(); }
};

Tensor softmax_impl(const Tensor& x, int64_t dim, bool log) {
  const char* name = log ? "log_softmax" : "softmax";
  detail::check_defined(x, name, "input");
  int64_t nd = x.dim();
  if (nd == 0) throw std::invalid_argument(std::string(name) + ": needs at least one dimension");
  int64_t d = dim < 0 ? dim + nd : dim;
  if (d < 0 || d >= nd) throw std::invalid_argument(std::string(name) + ": dim out of range");
  Tensor xl;
  {
    NoGradGuard no_grad;
    xl = x.transpose(d, nd - 1).contiguous();
  }
  int64_t inner = xl.size(-1), outer = xl.numel() / std::max<int64_t>(inner, 1);
  Tensor yl = empty(xl.sizes(), xl.options());
  detail::dispatch_floating(x.dtype(), name, [&](auto tag) {
    using T = decltype(tag);
    kSoftmax<T>.run(x.device(), yl.data<T>(), xl.data<T>(), outer, inner, log);
  });
  Tensor out;
  {
    NoGradGuard no_grad;
    out = yl.transpose(d, nd - 1).contiguous();
  }
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<SoftmaxBackward>();
    node->y = SavedTensor(out);
    node->dim = d;
    node->log = log;
    record(out, node, {&x});
  }
  return out;
}

struct CrossEntropyBackward final : Node {
  SavedTensor logits, lse, labels;
  const char* name() const override { return "CrossEntropyBackward"; }
  std::vector<Tensor> apply(const Tensor& g) override {
    Tensor x = logits.get(), l = lse.get(), y = labels.get();
    int64_t n = x.size(0), c = x.size(1);
    double scale = 1.0 / std::max<int64_t>(n, 1);
    Tensor gin = empty(x.sizes(), x.options());
    // g is a scalar in device memory: the kernel reads it there (no sync).
    Tensor gs = g.contiguous();
    detail::dispatch_floating(x.dtype(), "cross_entropy backward", [&](auto tag) {
      using T = decltype(tag);
      kCrossEntropyBackward<T>.run(x.device(), gin.data<T>(), x.data<T>(), l.data<T>(),
                                   y.data<int64_t>(), T(scale), gs.data<T>(), n, c);
    });
    return {gin, Tensor()};
  }
  void release_saved() override { logits.reset(); lse.reset(); labels.reset(); }
};

}  // namespace

Tensor sum(const Tensor& x, Shape dims, bool keepdim) { return reduce(x, dims, keepdim, false); }
Tensor mean(const Tensor& x, Shape dims, bool keepdim) { return reduce(x, dims, keepdim, true); }

std::pair<Tensor, Tensor> max(const Tensor& x, int64_t dim, bool keepdim) {
  detail::check_defined(x, "max", "input");
  Shape dims = normalize_dims({dim}, x.dim(), "max");
  if (x.size(dims[0]) == 0) throw std::invalid_argument("max: reduced dimension is empty");
  Rows r = to_rows(x, dims);
  Shape out_shape = keepdim ? r.keepdim_shape : r.kept_shape;
  Tensor values = empty(out_shape, x.options());
  Tensor indices = empty(out_shape, {DType::Int64, x.device()});
  detail::dispatch_floating(x.dtype(), "max", [&](auto tag) {
    using T = decltype(tag);
    kMaxRows<T>.run(x.device(), values.data<T>(), indices.data<int64_t>(), r.data.data<T>(),
                    r.outer, r.inner);
  });
  if (any_requires_grad({&x})) {
    auto node = std::make_shared<MaxBackward>();
    node->indices = SavedTensor(indices);
    node->input_shape = x.sizes();
    Shape perm, inverse(x.dim());
    for (int64_t d = 0; d < x.dim(); ++d)
      if (d != dims[0]) perm.push_back(d);
    perm.push_back(dims[0]);
    Shape permuted;
    for (size_t i = 0; i < perm.size(); ++i) {
      inverse[perm[i]] = static_cast<int64_t>(i);
      permuted.push_back(x.size(perm[i]));
    }
    node->perm_inverse = inverse;
    node->permuted_shape = permuted;
    node->outer = r.outer;
    node->inner = r.inner;
    record(values, node, {&x});
  }
  return {values, indices};
}

Tensor argmax(const Tensor& x, int64_t dim, bool keepdim) {
  NoGradGuard no_grad;
  return max(x, dim, keepdim).second;
}

Tensor softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, false); }
Tensor log_softmax(const Tensor& x, int64_t dim) { return softmax_impl(x, dim, true); }

namespace {

[[noreturn]] void throw_bad_labels(int64_t count, int64_t label, int64_t classes) {
  throw std::invalid_argument("cross_entropy: " + std::to_string(count) +
                              " label(s) outside [0, " + std::to_string(classes) +
                              "), for example " + std::to_string(label));
}

thread_local DeferredLabelCheck* t_label_check = nullptr;

}  // namespace

DeferredLabelCheck::DeferredLabelCheck(Device device)
    : device_(device), slots_(zeros({2}, {DType::Int64, device})), previous_(t_label_check) {
  t_label_check = this;
}

DeferredLabelCheck::~DeferredLabelCheck() { t_label_check = previous_; }

DeferredLabelCheck* DeferredLabelCheck::current(Device device) {
  return t_label_check && t_label_check->device_ == device ? t_label_check : nullptr;
}

int64_t* DeferredLabelCheck::slots(int64_t classes) {
  classes_ = classes;
  return slots_.data<int64_t>();
}

void DeferredLabelCheck::check() {
  auto v = slots_.to_vector<int64_t>();
  if (v[0]) throw_bad_labels(v[0], v[1], classes_);
}

Tensor cross_entropy(const Tensor& logits, const Tensor& labels) {
  detail::check_defined(logits, "cross_entropy", "logits");
  detail::check_defined(labels, "cross_entropy", "labels");
  if (logits.dim() != 2) {
    throw std::invalid_argument("cross_entropy: logits must be [N, C], got " +
                                logits.shape_str());
  }
  if (labels.dtype() != DType::Int64 || labels.dim() != 1 || labels.size(0) != logits.size(0)) {
    throw std::invalid_argument("cross_entropy: labels must be int64 [" +
                                std::to_string(logits.size(0)) + "], got " +
                                dtype_name(labels.dtype()) + " " + labels.shape_str());
  }
  if (labels.device() != logits.device()) {
    throw std::invalid_argument("cross_entropy: logits on " + logits.device().str() +
                                " but labels on " + labels.device().str());
  }
  int64_t n = logits.size(0), c = logits.size(1);
  Tensor x, y;
  {
    NoGradGuard no_grad;
    x = logits.contiguous();
    y = labels.contiguous();
  }
  Tensor loss_rows = empty({n}, x.options()), lse = empty({n}, x.options());
  // Bad labels are counted where the kernel runs: into a deferred check's
  // slots (read when the check is, so a GPU step never waits here), or
  // into slots of this call's own, read (and on a GPU waited for) now.
  DeferredLabelCheck* deferred = DeferredLabelCheck::current(x.device());
  Tensor slots = deferred ? Tensor() : zeros({2}, {DType::Int64, x.device()});
  detail::dispatch_floating(x.dtype(), "cross_entropy", [&](auto tag) {
    using T = decltype(tag);
    kCrossEntropy<T>.run(x.device(), loss_rows.data<T>(), lse.data<T>(), x.data<T>(),
                         y.data<int64_t>(), n, c,
                         deferred ? deferred->slots(c) : slots.data<int64_t>());
  });
  if (!deferred) {
    const auto bad = slots.to_vector<int64_t>();
    if (bad[0]) throw_bad_labels(bad[0], bad[1], c);
  }
  Tensor out;
  {
    NoGradGuard no_grad;
    out = mean(loss_rows);
  }
  if (any_requires_grad({&logits})) {
    auto node = std::make_shared<CrossEntropyBackward>();
    node->logits = SavedTensor(x);
    node->lse = SavedTensor(lse);
    node->labels = SavedTensor(y);
    record(out, node, {&logits, &labels});
  }
  return out;
}

Tensor mse_loss(const Tensor& input, const Tensor& target) {
  if (input.sizes() != target.sizes()) {
    throw std::invalid_argument("mse_loss: input " + input.shape_str() + " and target " +
                                target.shape_str() + " differ");
  }
  Tensor d = sub(input, target);
  return mean(mul(d, d));
}

Tensor l1_loss(const Tensor& input, const Tensor& target) {
  if (input.sizes() != target.sizes()) {
    throw std::invalid_argument("l1_loss: input " + input.shape_str() + " and target " +
                                target.shape_str() + " differ");
  }
  return mean(abs(sub(input, target)));
}

}  // namespace leasehold::engine
