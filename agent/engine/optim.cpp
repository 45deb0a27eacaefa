#include "agent/engine/optim.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <stdexcept>
#include <utility>

#include "agent/engine/autograd.h"
#include "agent/engine/cuda_context.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/kernel_table.h"
#include "agent/engine/ops.h"
#include "kernels/optim.h"

namespace leasehold::engine::optim {
namespace {

const KernelTable<decltype(kernels::cpu::advance_step)> kAdvanceStep{
    "optimizer step",
    {&kernels::cpu::advance_step, LEASEHOLD_CUDA_KERNEL(kernels::cuda::advance_step)}};
template <class T>
const auto kSgdStep = LEASEHOLD_KERNEL_TABLE("SGD", sgd_step, T);
template <class T>
const auto kAdamStep = LEASEHOLD_KERNEL_TABLE("Adam", adam_step_fused, T);
template <class T>
const auto kSumSquares = LEASEHOLD_KERNEL_TABLE("clip_grad_norm", sum_squares_fused, T);
template <class T>
const auto kScale = LEASEHOLD_KERNEL_TABLE("clip_grad_norm", scale_fused, T);

void check_lr(double lr, const char* who) {
  if (!(lr > 0)) throw std::invalid_argument(std::string(who) + ": lr must be positive");
}

Tensor dense_grad(const Tensor& p) {
  Tensor g = p.grad();
  return g.is_contiguous() ? g : g.contiguous();
}

const Tensor& lookup(const std::map<std::string, Tensor>& m, const std::string& key,
                     const Tensor& like) {
  auto it = m.find(key);
  if (it == m.end()) throw std::invalid_argument("optimizer state lacks '" + key + "'");
  if (it->second.sizes() != like.sizes() || it->second.dtype() != like.dtype()) {
    throw std::invalid_argument("optimizer state '" + key + "' has shape " +
                                it->second.shape_str() + ", expected " + like.shape_str());
  }
  return it->second;
}

}  // namespace

Optimizer::Optimizer(nn::NamedTensors params, double lr)
    : params_(std::move(params)), schedule_(LrSchedule::constant(lr)) {
  for (auto& [name, p] : params_) {
    if (!p.is_leaf() || !p.requires_grad() || !p.is_contiguous()) {
      throw std::invalid_argument("optimizer: parameter '" + name +
                                  "' must be a contiguous leaf that requires grad");
    }
  }
  steps_ = zeros({}, {DType::Int64, params_.empty() ? Device::cpu() : params_[0].second.device()});
}

void Optimizer::step() {
  NoGradGuard no_grad;
  kAdvanceStep.run(steps_.device(), steps_.data<int64_t>());
  update();
}

void Optimizer::zero_grad() {
  for (auto& [name, p] : params_) p.set_grad(Tensor());
}

int64_t Optimizer::steps() const { return static_cast<int64_t>(steps_.item()); }

void Optimizer::set_steps(int64_t n) {
  if (n < 0) throw std::invalid_argument("optimizer: a step count cannot be negative");
  steps_.copy_(from_vector<int64_t>({n}, {}));
}

double Optimizer::lr() const { return schedule_.at(steps()); }

void Optimizer::set_lr(double lr) {
  check_lr(lr, "optimizer");
  schedule_ = LrSchedule::constant(lr);
}

void Optimizer::set_schedule(const LrSchedule& schedule) {
  check_lr(schedule.lr, "optimizer schedule");
  if (schedule.decays) {
    check_lr(schedule.min_lr, "optimizer schedule's floor");
    if (schedule.warmup < 0 || schedule.total < 1) {
      throw std::invalid_argument("optimizer schedule: warm-up must be >= 0 and total >= 1");
    }
  }
  schedule_ = schedule;
}

SGD::SGD(nn::NamedTensors params, SgdOptions o) : Optimizer(std::move(params), o.lr), opt_(o) {
  check_lr(o.lr, "SGD");
  if (o.momentum < 0 || o.weight_decay < 0) {
    throw std::invalid_argument("SGD: momentum and weight_decay must be non-negative");
  }
  momentum_.resize(params_.size());
}

void SGD::update() {
  kernels::SgdParams s{schedule(), opt_.momentum, opt_.weight_decay, !started_, step_pointer()};
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i].second;
    if (!p.grad().defined()) continue;
    Tensor g = dense_grad(p);
    if (opt_.momentum != 0 && !momentum_[i].defined()) {
      momentum_[i] = zeros(p.sizes(), p.options());
      s.first_step = true;
    }
    detail::dispatch_floating(p.dtype(), "SGD", [&](auto tag) {
      using T = decltype(tag);
      T* buf = momentum_[i].defined() ? momentum_[i].data<T>() : nullptr;
      kSgdStep<T>.run(p.device(), p.data<T>(), g.data<T>(), buf, p.numel(), s);
    });
    s.first_step = !started_;
  }
  started_ = true;
}

nn::NamedTensors SGD::state() const {
  nn::NamedTensors out;
  out.emplace_back("sgd.step", step_counter().reshape({1}));
  for (size_t i = 0; i < params_.size(); ++i) {
    if (momentum_[i].defined()) out.emplace_back("sgd.momentum." + params_[i].first, momentum_[i]);
  }
  return out;
}

void SGD::load_state(const nn::NamedTensors& state) {
  std::map<std::string, Tensor> m(state.begin(), state.end());
  // (Checkpoints from before the step counter have none: the job sets it.)
  if (auto it = m.find("sgd.step"); it != m.end()) set_steps(static_cast<int64_t>(it->second.item()));
  for (size_t i = 0; i < params_.size(); ++i) {
    auto key = "sgd.momentum." + params_[i].first;
    if (m.count(key)) {
      Tensor buf = zeros(params_[i].second.sizes(), params_[i].second.options());
      buf.copy_(lookup(m, key, params_[i].second));
      momentum_[i] = buf;
      started_ = true;
    }
  }
}

Adam::Adam(nn::NamedTensors params, AdamOptions o) : Optimizer(std::move(params), o.lr), opt_(o) {
  check_lr(o.lr, "Adam");
  if (o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1 || o.eps <= 0 ||
      o.weight_decay < 0) {
    throw std::invalid_argument("Adam: betas must be in [0, 1), eps positive, weight_decay >= 0");
  }
  m_.resize(params_.size());
  v_.resize(params_.size());
  on_host_.resize(params_.size(), 0);
  // The moments of every parameter (each requires grad: the base checks)
  // are made now, beside the parameters, before any step's tensors exist:
  // made at the first update (as PyTorch does), they landed among that
  // step's gradients and scratch, and the job's pages of the GPT (127 MiB
  // of parameters and state) held 70 of 2 MiB, six more than they fill,
  // which made a 404 MiB budget send one block's input more to host memory
  // (paged_resource.h).
  for (size_t i = 0; i < params_.size(); ++i) {
    m_[i] = new_state(i);
    v_[i] = new_state(i);
  }
}

void Adam::update() {
  const kernels::AdamParams decays{schedule(), opt_.beta1,     opt_.beta2,    opt_.eps,
                                   opt_.weight_decay, opt_.decoupled, step_pointer()};
  kernels::AdamParams no_decay = decays;
  no_decay.weight_decay = 0;
  auto params_of = [&](const Tensor& p) -> const kernels::AdamParams& {
    return opt_.decay_matrices_only && p.dim() < 2 ? no_decay : decays;
  };
  // Parameters of one dtype, device and weight decay go together, up to
  // kMaxFusedTensors per update (one launch on CUDA: kernels/optim.h): the
  // decaying ones first, then the rest (a model's weights and biases
  // alternate, and grouping them in order made a launch of each).
  std::vector<Tensor> grads;  // alive until their launch is queued
  std::vector<size_t> pending;
  auto flush = [&] {
    if (pending.empty()) return;
    const Tensor& first = params_[pending[0]].second;
    detail::dispatch_floating(first.dtype(), "Adam", [&](auto tag) {
      using T = decltype(tag);
      kernels::AdamTensors<T> t;
      int64_t total = 0;
      for (size_t j = 0; j < pending.size(); ++j) {
        size_t i = pending[j];
        Tensor& p = params_[i].second;
        t.p[j] = p.data<T>();
        t.g[j] = grads[j].data<T>();
        t.m[j] = m_[i].data<T>();
        t.v[j] = v_[i].data<T>();
        total += p.numel();
        t.end[j] = total;
      }
      t.count = static_cast<int>(pending.size());
      kAdamStep<T>.run(first.device(), t, params_of(first));
    });
    pending.clear();
    grads.clear();
  };
  const kernels::AdamParams* const groups[] = {&decays, &no_decay};
  for (const kernels::AdamParams* group : groups) {
    for (size_t i = 0; i < params_.size(); ++i) {
      Tensor& p = params_[i].second;
      if (!p.grad().defined() || &params_of(p) != group) continue;
      Tensor g = dense_grad(p);
      if (!pending.empty()) {
        const Tensor& first = params_[pending[0]].second;
        if (first.dtype() != p.dtype() || first.device() != p.device() ||
            pending.size() == static_cast<size_t>(kernels::kMaxFusedTensors)) {
          flush();
        }
      }
      pending.push_back(i);
      grads.push_back(g);
    }
    flush();
  }
}

nn::NamedTensors Adam::state() const {
#ifdef LEASEHOLD_HAVE_CUDA
  // (State in host memory is read as it is: the updates queued on the
  // device must have written it first.)
  if (host_state_bytes() > 0) {
    std::set<int> devices;
    for (const auto& [name, p] : params_) {
      if (p.device().is_cuda()) devices.insert(p.device().index);
    }
    for (int d : devices) synchronize(d);
  }
#endif
  nn::NamedTensors out;
  out.emplace_back("adam.step", step_counter().reshape({1}));
  for (size_t i = 0; i < params_.size(); ++i) {
    out.emplace_back("adam.m." + params_[i].first, m_[i]);
    out.emplace_back("adam.v." + params_[i].first, v_[i]);
  }
  return out;
}

void Adam::load_state(const nn::NamedTensors& state) {
  std::map<std::string, Tensor> m(state.begin(), state.end());
  auto it = m.find("adam.step");
  if (it == m.end()) throw std::invalid_argument("optimizer state lacks 'adam.step'");
  const auto steps = static_cast<int64_t>(it->second.item());
  // Every parameter's moments checked before any is copied: a bad one
  // leaves the state as it was.
  std::vector<std::pair<Tensor, Tensor>> loaded(params_.size());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i].second;
    auto mk = "adam.m." + params_[i].first, vk = "adam.v." + params_[i].first;
    if (!m.count(mk)) continue;
    loaded[i] = {lookup(m, mk, p), lookup(m, vk, p)};
  }
  set_steps(steps);
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!loaded[i].first.defined()) continue;
    // (Into the moments made with the optimizer, where they are: new ones
    // would leave holes among the parameters' pages.)
    m_[i].copy_(loaded[i].first);
    v_[i].copy_(loaded[i].second);
  }
}

Tensor Adam::new_state(size_t i) const {
  const Tensor& p = params_[i].second;
#ifdef LEASEHOLD_HAVE_CUDA
  if (on_host_[i] && p.device().is_cuda()) {
    AllocatorGuard pinned(pinned_host_allocator());
    return zeros(p.sizes(), {p.dtype(), Device::cpu()});
  }
#endif
  return zeros(p.sizes(), p.options());
}

uint64_t Adam::state_bytes(size_t i) const {
  const Tensor& p = params_[i].second;
  return 2 * static_cast<uint64_t>(p.numel()) * dtype_size(p.dtype());
}

uint64_t Adam::gpu_parameters_state_bytes() const {
  uint64_t bytes = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].second.device().is_cuda()) bytes += state_bytes(i);
  }
  return bytes;
}

uint64_t Adam::host_state_bytes() const {
  uint64_t bytes = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (on_host_[i]) bytes += state_bytes(i);
  }
  return bytes;
}

bool Adam::move_state([[maybe_unused]] uint64_t at_least_bytes) {
#ifdef LEASEHOLD_HAVE_CUDA
  NoGradGuard no_grad;
  // Which parameters' state goes: whole ones, in order, until enough.
  std::vector<size_t> moving;
  uint64_t bytes = 0;
  for (size_t i = 0; i < params_.size() && bytes < at_least_bytes; ++i) {
    if (on_host_[i] || !params_[i].second.device().is_cuda()) continue;
    moving.push_back(i);
    bytes += state_bytes(i);
  }
  if (moving.empty()) return false;
  // Every copy made before any is swapped in: a host allocation that fails
  // (the job's host tier full, allocator.h: PinnedHostGuard) leaves the
  // state where it was, and moves nothing. (The state exists from the
  // optimizer's making: the first update never has to find host memory.)
  std::vector<Tensor> m = m_, v = v_;
  try {
    AllocatorGuard pinned(pinned_host_allocator());
    for (size_t i : moving) {
      const Tensor& p = params_[i].second;
      m[i] = empty(p.sizes(), {p.dtype(), Device::cpu()});
      v[i] = empty(p.sizes(), {p.dtype(), Device::cpu()});
      m[i].copy_(m_[i]);
      v[i].copy_(v_[i]);
    }
  } catch (const OutOfMemoryError& e) {
    spdlog::warn("the optimizer's state of {} parameters stays on the device: {}", moving.size(),
                 e.what());
    return false;
  }
  m_.swap(m);
  v_.swap(v);
  for (size_t i : moving) on_host_[i] = 1;
  return true;
#else
  return false;
#endif
}

Tensor clip_grad_norm(const nn::NamedTensors& params, double max_norm) {
  if (!(max_norm > 0)) throw std::invalid_argument("clip_grad_norm: max_norm must be positive");
  NoGradGuard no_grad;
  std::vector<Tensor> grads;
  for (const auto& [name, p] : params) {
    if (!p.grad().defined()) continue;
    if (!grads.empty() && (p.grad().device() != grads[0].device() ||
                           p.grad().dtype() != grads[0].dtype())) {
      throw std::invalid_argument("clip_grad_norm: gradient of '" + name + "' is " +
                                  dtype_name(p.grad().dtype()) + " on " +
                                  p.grad().device().str() + ", the first was " +
                                  dtype_name(grads[0].dtype()) + " on " +
                                  grads[0].device().str());
    }
    grads.push_back(p.grad());
  }
  if (grads.empty()) return Tensor();
  // The fused passes take dense memory: a strided gradient is scaled in a
  // dense copy, then copied back.
  std::vector<std::pair<Tensor, Tensor>> strided;  // (gradient, its dense copy)
  for (Tensor& g : grads) {
    if (g.is_contiguous()) continue;
    strided.emplace_back(g, g.contiguous());
    g = strided.back().second;
  }
  const Device device = grads[0].device();
  const auto n = static_cast<int64_t>(grads.size());
  // Each gradient's squares in kNormParts parts (a launch per
  // kMaxFusedTensors gradients), then their sum: the same order every step.
  Tensor partial = empty({n * kernels::kNormParts}, grads[0].options());
  // launch(t, first) for each group of kMaxFusedTensors gradients.
  auto each_launch = [&](auto&& launch) {
    detail::dispatch_floating(grads[0].dtype(), "clip_grad_norm", [&](auto tag) {
      using T = decltype(tag);
      for (int64_t first = 0; first < n; first += kernels::kMaxFusedTensors) {
        kernels::GradTensors<T> t;
        int64_t total = 0;
        for (int64_t j = first; j < std::min(n, first + kernels::kMaxFusedTensors); ++j) {
          t.g[t.count] = grads[j].data<T>();
          total += grads[j].numel();
          t.end[t.count++] = total;
        }
        launch(t, first);
      }
    });
  };
  each_launch([&]<class T>(const kernels::GradTensors<T>& t, int64_t first) {
    kSumSquares<T>.run(device, t, partial.data<T>() + first * kernels::kNormParts);
  });
  const Tensor norm = sqrt(sum(partial));
  // min(1, max_norm / (norm + eps)) without a comparison op or a host read:
  // max_norm / (max_norm + relu(norm + eps - max_norm)).
  const Tensor coef = div(full({}, max_norm, norm.options()),
                          add(relu(add(norm, 1e-6 - max_norm)), max_norm));
  each_launch([&]<class T>(const kernels::GradTensors<T>& t, int64_t) {
    kScale<T>.run(device, t, coef.data<T>());
  });
  for (auto& [g, dense] : strided) g.copy_(dense);
  return norm;
}

}  // namespace leasehold::engine::optim
