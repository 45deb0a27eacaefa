#include "agent/engine/tensor.h"

#include <cstring>
#include <mutex>
#include <random>
#include <sstream>
#include <stdexcept>

#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/kernel_table.h"
#include "kernels/elementwise.h"
#ifdef LEASEHOLD_HAVE_CUDA
#include "shared/cuda_check.h"
#endif

namespace leasehold::engine {
namespace {

template <class T>
const auto kFill = LEASEHOLD_KERNEL_TABLE("fill_", fill, T);
template <class T>
const auto kStridedCopy = LEASEHOLD_KERNEL_TABLE("copy_", strided_copy, T);
template <class To, class From>
const auto kConvert = LEASEHOLD_KERNEL_TABLE("to(dtype)", convert, To, From);
template <class T>
const auto kUniformFill = LEASEHOLD_KERNEL_TABLE("rand", uniform_fill, T);

}  // namespace

int64_t numel_of(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Shape contiguous_strides(const Shape& sizes) {
  Shape st(sizes.size());
  int64_t acc = 1;
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    st[d] = acc;
    acc *= std::max<int64_t>(sizes[d], 1);
  }
  return st;
}

std::string shape_to_string(const Shape& s) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  os << "]";
  return os.str();
}

int64_t Tensor::size(int64_t d) const {
  int64_t n = dim();
  int64_t i = d < 0 ? d + n : d;
  if (i < 0 || i >= n) {
    throw std::invalid_argument("dimension " + std::to_string(d) + " out of range for a " +
                                std::to_string(n) + "-d tensor");
  }
  return impl_->sizes[i];
}

int64_t Tensor::numel() const { return numel_of(impl_->sizes); }

bool Tensor::is_contiguous() const {
  int64_t expected = 1;
  for (int64_t d = dim() - 1; d >= 0; --d) {
    if (impl_->sizes[d] != 1 && impl_->strides[d] != expected) return false;
    expected *= impl_->sizes[d];
  }
  return true;
}

void* Tensor::raw_data() const {
  return static_cast<char*>(impl_->storage->data()) + impl_->offset * dtype_size(impl_->dtype);
}

template <class T>
T* Tensor::data() const {
  if (dtype_of<T>() != impl_->dtype) {
    throw std::invalid_argument(std::string("tensor of dtype ") + dtype_name(impl_->dtype) +
                                " read as " + dtype_name(dtype_of<T>()));
  }
  return static_cast<T*>(raw_data());
}
template float* Tensor::data<float>() const;
template double* Tensor::data<double>() const;
template int64_t* Tensor::data<int64_t>() const;
template bfloat16* Tensor::data<bfloat16>() const;

bool Tensor::requires_grad() const { return impl_->requires_grad || impl_->grad_fn != nullptr; }

Tensor& Tensor::set_requires_grad(bool value) {
  if (!is_leaf()) {
    throw std::invalid_argument(
        "set_requires_grad: only leaf tensors can change requires_grad (use detach())");
  }
  if (value && !is_floating(dtype())) {
    throw std::invalid_argument(std::string("set_requires_grad: ") + dtype_name(dtype()) +
                                " tensors cannot require gradients");
  }
  impl_->requires_grad = value;
  return *this;
}

void Tensor::backward(const Tensor& gradient, bool retain_graph) const {
  run_backward(*this, gradient, retain_graph);
}

std::string Tensor::shape_str() const { return shape_to_string(sizes()); }

// A contiguous tensor of `sizes` over `storage` (made for its bytes).
template <class MakeStorage>
static Tensor contiguous_tensor(const Shape& sizes, DType dtype, MakeStorage make_storage) {
  for (int64_t d : sizes) {
    if (d < 0) throw std::invalid_argument("negative size in shape " + shape_to_string(sizes));
  }
  auto impl = std::make_shared<TensorImpl>();
  impl->sizes = sizes;
  impl->strides = contiguous_strides(sizes);
  impl->dtype = dtype;
  impl->storage = make_storage(numel_of(sizes) * dtype_size(dtype));
  return Tensor(impl);
}

Tensor empty(const Shape& sizes, TensorOptions options) {
  return contiguous_tensor(sizes, options.dtype, [&](size_t bytes) {
    return std::make_shared<Storage>(bytes, current_allocator(options.device));
  });
}

void Tensor::fill_(double value) {
  Tensor& self = *this;
  detail::dispatch_all(dtype(), [&](auto tag) {
    using T = decltype(tag);
    Tensor dense = self.is_contiguous() ? self : empty(self.sizes(), self.options());
    kFill<T>.run(device(), dense.data<T>(), T(value), dense.numel());
    if (dense.impl() != self.impl()) self.copy_(dense);
  });
}

Tensor from_blob(void* data, const Shape& sizes, TensorOptions options,
                 std::shared_ptr<void> keepalive) {
  return contiguous_tensor(sizes, options.dtype, [&](size_t bytes) {
    return Storage::borrowed(data, bytes, options.device, std::move(keepalive));
  });
}

Tensor zeros(const Shape& sizes, TensorOptions options) { return full(sizes, 0.0, options); }
Tensor ones(const Shape& sizes, TensorOptions options) { return full(sizes, 1.0, options); }
Tensor full(const Shape& sizes, double value, TensorOptions options) {
  Tensor t = empty(sizes, options);
  t.fill_(value);
  return t;
}
Tensor scalar_tensor(double value, TensorOptions options) { return full({}, value, options); }

// Copies between host memory and a (contiguous) tensor on any device.
static void copy_bytes(void* dst, Device dst_dev, const void* src, Device src_dev, size_t n,
                       Device stream_dev) {
  if (n == 0) return;
  if (!dst_dev.is_cuda() && !src_dev.is_cuda()) {
    std::memcpy(dst, src, n);
    return;
  }
#ifdef LEASEHOLD_HAVE_CUDA
  cudaStream_t s = compute_stream(stream_dev.index);
  // (A step traced only has no bytes to copy: cuda_context.h. Its waits
  // for the host still fail its capture, as they would the real one.)
  if (!tracing_step()) LEASEHOLD_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, s));
  // Host memory may be reused as soon as we return.
  if (!dst_dev.is_cuda() || !src_dev.is_cuda()) {
    note_host_wait();
    LEASEHOLD_CUDA_CHECK(cudaStreamSynchronize(s));
  }
#else
  (void)stream_dev;
  detail::no_cuda("copy");
#endif
}

template <class T>
Tensor from_vector(const std::vector<T>& values, const Shape& sizes, Device device) {
  if (static_cast<int64_t>(values.size()) != numel_of(sizes)) {
    throw std::invalid_argument("from_vector: " + std::to_string(values.size()) +
                                " values do not fill shape " + shape_to_string(sizes));
  }
  Tensor t = empty(sizes, TensorOptions{dtype_of<T>(), device});
  copy_bytes(t.raw_data(), device, values.data(), Device::cpu(), values.size() * sizeof(T),
             device);
  return t;
}
template Tensor from_vector<float>(const std::vector<float>&, const Shape&, Device);
template Tensor from_vector<double>(const std::vector<double>&, const Shape&, Device);
template Tensor from_vector<int64_t>(const std::vector<int64_t>&, const Shape&, Device);

void Tensor::copy_(const Tensor& src) {
  if (src.dtype() != dtype()) {
    throw std::invalid_argument(std::string("copy_: dtype ") + dtype_name(src.dtype()) +
                                " into " + dtype_name(dtype()) + " (convert with to() first)");
  }
  if (src.sizes() != sizes()) {
    throw std::invalid_argument("copy_: shape " + src.shape_str() + " into " + shape_str());
  }
  NoGradGuard no_grad;
  Tensor source = src;
  if (src.device() != device()) {
    // Move a dense copy across, then finish on this tensor's device.
    Tensor dense = src.contiguous();
    Tensor moved = empty(sizes(), options());
    Device cuda_side = device().is_cuda() ? device() : src.device();
    copy_bytes(moved.raw_data(), device(), dense.raw_data(), src.device(),
               numel() * dtype_size(dtype()), cuda_side);
    source = moved;
  }
  if (source.impl() == impl_) return;
  Tensor& self = *this;
  // (Both dense and apart: a plain copy of the bytes, which the device's
  // copy does faster than an indexing kernel: a recomputed MLP's input
  // gradient, in slices, is gathered so. Views of one storage, or storages
  // over borrowed memory, may overlap: those take the kernel.)
  const size_t bytes = numel() * dtype_size(dtype());
  const auto to = reinterpret_cast<uintptr_t>(raw_data());
  const auto from = reinterpret_cast<uintptr_t>(source.raw_data());
  if (is_contiguous() && source.is_contiguous() && (to + bytes <= from || from + bytes <= to)) {
    copy_bytes(raw_data(), device(), source.raw_data(), source.device(), bytes, device());
    return;
  }
  detail::dispatch_storage(dtype(), [&](auto tag) {
    using T = decltype(tag);
    auto dv = detail::strided_of(self), sv = detail::strided_of(source);
    kStridedCopy<T>.run(device(), self.data<T>(), dv, source.data<T>(), sv, numel());
  });
}

Tensor Tensor::to(Device device) const {
  if (device == this->device()) return *this;
  if (requires_grad()) {
    // Moving between devices is not differentiable here; say so rather than
    // silently cutting the graph.
    throw std::invalid_argument("to(" + device.str() +
                                ") of a tensor that requires grad: move detach()ed leaves "
                                "(parameters) before building the graph");
  }
  Tensor out = empty(sizes(), {dtype(), device});
  out.copy_(*this);
  return out;
}

Tensor Tensor::to(DType target) const {
  if (target == dtype()) return *this;
  if (target == DType::BFloat16 || dtype() == DType::BFloat16) {
    // bfloat16 converts to and from float32 only; other types go through it.
    if (dtype() != DType::Float32 && dtype() != DType::BFloat16) {
      return to(DType::Float32).to(target);
    }
    if (target != DType::Float32 && target != DType::BFloat16) {
      return to(DType::Float32).to(target);
    }
    const Tensor src = contiguous();
    Tensor out = empty(sizes(), {target, device()});
    if (target == DType::BFloat16) {
      kConvert<bfloat16, float>.run(device(), out.data<bfloat16>(), src.data<float>(), numel());
    } else {
      kConvert<float, bfloat16>.run(device(), out.data<float>(), src.data<bfloat16>(), numel());
    }
    return out;
  }
  Tensor src = contiguous();
  Tensor out = empty(sizes(), {target, device()});
  int64_t n = numel();
  detail::dispatch_all(dtype(), [&](auto from_tag) {
    using From = decltype(from_tag);
    detail::dispatch_all(target, [&](auto to_tag) {
      using To = decltype(to_tag);
      if constexpr (!std::is_same_v<To, From>) {
        kConvert<To, From>.run(device(), out.data<To>(), src.data<From>(), n);
      }
    });
  });
  return out;
}

template <class T>
std::vector<T> Tensor::to_vector() const {
  // Reading values is not part of the graph.
  Tensor host = detach().to(Device::cpu()).contiguous();
  const T* p = host.data<T>();
  return std::vector<T>(p, p + numel());
}
template std::vector<float> Tensor::to_vector<float>() const;
template std::vector<double> Tensor::to_vector<double>() const;
template std::vector<int64_t> Tensor::to_vector<int64_t>() const;

double Tensor::item() const {
  if (numel() != 1) {
    throw std::invalid_argument("item() of a tensor with " + std::to_string(numel()) +
                                " elements");
  }
  if (dtype() == DType::BFloat16) return detach().to(DType::Float32).item();
  return detail::dispatch_all(dtype(), [&](auto tag) {
    using T = decltype(tag);
    return static_cast<double>(detach().to_vector<T>()[0]);
  });
}

// ---- random numbers ----

namespace {
std::mutex g_rng_mu;
std::mt19937_64 g_rng(0x1ea5e401dULL);
}  // namespace

void manual_seed(uint64_t seed) {
  std::lock_guard lock(g_rng_mu);
  g_rng.seed(seed);
}

uint64_t next_random_u64() {
  std::lock_guard lock(g_rng_mu);
  return g_rng();
}

namespace {
thread_local StepRandom* t_step_random = nullptr;
}  // namespace

StepRandom::StepRandom(uint64_t seed, Tensor step)
    : seed_(seed), step_(std::move(step)), previous_(t_step_random) {
  if (!step_.defined() || step_.dtype() != DType::Int64 || step_.numel() != 1) {
    throw std::invalid_argument("StepRandom: the step counter must be one int64");
  }
  t_step_random = this;
}

StepRandom::~StepRandom() { t_step_random = previous_; }

std::optional<RandomPlace> RandomPlace::here() {
  StepRandom* scope = t_step_random;
  if (!scope) return std::nullopt;
  return RandomPlace{scope->seed_, scope->step_, scope->drawn_};
}

RandomReplay::RandomReplay(const RandomPlace& place) : scope_(place.seed, place.step) {
  scope_.drawn_ = place.drawn;
}

RandomDraw RandomDraw::next(Device device) {
  StepRandom* scope = t_step_random;
  if (!scope) return {next_random_u64(), Tensor()};
  RandomDraw d{kernels::pattern_word(scope->seed_, scope->drawn_++), Tensor()};
  if (scope->step_.device() == device) d.step = scope->step_;
  return d;
}

template <class Dist>
static Tensor random_tensor(const Shape& sizes, TensorOptions options, Dist dist) {
  std::vector<double> v(numel_of(sizes));
  {
    std::lock_guard lock(g_rng_mu);
    for (auto& x : v) x = dist(g_rng);
  }
  Tensor t = from_vector(v, sizes, options.device);
  return options.dtype == DType::Float64 ? t : t.to(options.dtype);
}

Tensor rand(const Shape& sizes, TensorOptions options, double low, double high) {
  // Counter-based (one seed from the generator, then uniform(seed, i) per
  // element): filled where the tensor lives, the same values on CPU and
  // GPU, and no host work per element (a model's initialisation is on the
  // path to a job's first step).
  Tensor t = empty(sizes, options);
  const uint64_t seed = next_random_u64();
  detail::dispatch_floating(options.dtype, "rand", [&](auto tag) {
    using T = decltype(tag);
    kUniformFill<T>.run(options.device, t.data<T>(), t.numel(), low, high, seed);
  });
  return t;
}

Tensor randn(const Shape& sizes, TensorOptions options, double mean, double std) {
  return random_tensor(sizes, options, std::normal_distribution<double>(mean, std));
}

Tensor arange(int64_t n, TensorOptions options) {
  std::vector<int64_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = i;
  Tensor t = from_vector(v, {n}, options.device);
  return options.dtype == DType::Int64 ? t : t.to(options.dtype);
}

// ---- dispatch helpers ----

namespace detail {

kernels::Strided strided_of(const Tensor& t) {
  if (t.dim() > kernels::kMaxDims) {
    throw std::invalid_argument("tensors of more than " + std::to_string(kernels::kMaxDims) +
                                " dimensions are not supported");
  }
  kernels::Strided s;
  s.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < s.ndim; ++d) {
    s.sizes[d] = t.sizes()[d];
    s.strides[d] = t.strides()[d];
  }
  s.detect_contiguous();
  return s;
}

kernels::Strided broadcast_strided(const Tensor& t, const Shape& out) {
  if (static_cast<int64_t>(out.size()) > kernels::kMaxDims) {
    throw std::invalid_argument("tensors of more than 8 dimensions are not supported");
  }
  kernels::Strided s;
  s.ndim = static_cast<int>(out.size());
  int64_t lead = static_cast<int64_t>(out.size()) - t.dim();
  for (int d = 0; d < s.ndim; ++d) {
    s.sizes[d] = out[d];
    int64_t td = d - lead;
    s.strides[d] = (td < 0 || t.sizes()[td] == 1) ? 0 : t.strides()[td];
  }
  s.detect_contiguous();
  return s;
}

void check_defined(const Tensor& t, const char* op, const char* what) {
  if (!t.defined()) throw std::invalid_argument(std::string(op) + ": " + what + " is undefined");
}

void check_same(const Tensor& a, const Tensor& b, const char* op) {
  check_defined(a, op, "first input");
  check_defined(b, op, "second input");
  if (a.dtype() != b.dtype()) {
    throw std::invalid_argument(std::string(op) + ": dtypes differ (" + dtype_name(a.dtype()) +
                                " and " + dtype_name(b.dtype()) + ")");
  }
  if (a.device() != b.device()) {
    throw std::invalid_argument(std::string(op) + ": devices differ (" + a.device().str() +
                                " and " + b.device().str() + ")");
  }
}

void no_cuda(const char* op) {
  throw std::runtime_error(std::string(op) + ": CUDA tensors need a build with CUDA support");
}

}  // namespace detail
}  // namespace leasehold::engine
