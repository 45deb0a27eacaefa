#include "agent/engine/optim.h"

#include <map>
#include <stdexcept>

#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "kernels/optim.h"

namespace leasehold::engine::optim {
namespace {

void check_options(double lr, const char* who) {
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

Optimizer::Optimizer(nn::NamedTensors params) : params_(std::move(params)) {
  for (auto& [name, p] : params_) {
    if (!p.is_leaf() || !p.requires_grad() || !p.is_contiguous()) {
      throw std::invalid_argument("optimizer: parameter '" + name +
                                  "' must be a contiguous leaf that requires grad");
    }
  }
}

void Optimizer::zero_grad() {
  for (auto& [name, p] : params_) p.set_grad(Tensor());
}

SGD::SGD(nn::NamedTensors params, SgdOptions o) : Optimizer(std::move(params)), opt_(o) {
  check_options(o.lr, "SGD");
  if (o.momentum < 0 || o.weight_decay < 0) {
    throw std::invalid_argument("SGD: momentum and weight_decay must be non-negative");
  }
  momentum_.resize(params_.size());
}

void SGD::step() {
  NoGradGuard no_grad;
  kernels::SgdParams s{opt_.lr, opt_.momentum, opt_.weight_decay, !started_};
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
      if (p.device().is_cuda()) {
        LEASEHOLD_CUDA_OR("SGD", kernels::cuda::sgd_step<T>(p.data<T>(), g.data<T>(), buf,
                                                            p.numel(), s, detail::stream_of(p)));
      } else {
        kernels::cpu::sgd_step<T>(p.data<T>(), g.data<T>(), buf, p.numel(), s);
      }
    });
    s.first_step = !started_;
  }
  started_ = true;
}

nn::NamedTensors SGD::state() const {
  nn::NamedTensors out;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (momentum_[i].defined()) out.emplace_back("sgd.momentum." + params_[i].first, momentum_[i]);
  }
  return out;
}

void SGD::load_state(const nn::NamedTensors& state) {
  std::map<std::string, Tensor> m(state.begin(), state.end());
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

Adam::Adam(nn::NamedTensors params, AdamOptions o) : Optimizer(std::move(params)), opt_(o) {
  check_options(o.lr, "Adam");
  if (o.beta1 < 0 || o.beta1 >= 1 || o.beta2 < 0 || o.beta2 >= 1 || o.eps <= 0 ||
      o.weight_decay < 0) {
    throw std::invalid_argument("Adam: betas must be in [0, 1), eps positive, weight_decay >= 0");
  }
  m_.resize(params_.size());
  v_.resize(params_.size());
}

void Adam::step() {
  NoGradGuard no_grad;
  ++step_;
  kernels::AdamParams a{opt_.lr, opt_.beta1, opt_.beta2, opt_.eps, opt_.weight_decay, step_};
  // CUDA parameters of one dtype and device go together, up to
  // kMaxFusedTensors per launch (kernels/optim.h).
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
      LEASEHOLD_CUDA_OR("Adam", kernels::cuda::adam_step_fused<T>(t, a, detail::stream_of(first)));
    });
    pending.clear();
    grads.clear();
  };
  for (size_t i = 0; i < params_.size(); ++i) {
    Tensor& p = params_[i].second;
    if (!p.grad().defined()) continue;
    Tensor g = dense_grad(p);
    if (!m_[i].defined()) {
      m_[i] = zeros(p.sizes(), p.options());
      v_[i] = zeros(p.sizes(), p.options());
    }
    if (p.device().is_cuda()) {
      if (!pending.empty()) {
        const Tensor& first = params_[pending[0]].second;
        if (first.dtype() != p.dtype() || first.device() != p.device() ||
            pending.size() == static_cast<size_t>(kernels::kMaxFusedTensors)) {
          flush();
        }
      }
      pending.push_back(i);
      grads.push_back(g);
      continue;
    }
    detail::dispatch_floating(p.dtype(), "Adam", [&](auto tag) {
      using T = decltype(tag);
      kernels::cpu::adam_step<T>(p.data<T>(), g.data<T>(), m_[i].data<T>(), v_[i].data<T>(),
                                 p.numel(), a);
    });
  }
  flush();
}

nn::NamedTensors Adam::state() const {
  nn::NamedTensors out;
  out.emplace_back("adam.step", from_vector<int64_t>({step_}, {1}));
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!m_[i].defined()) continue;
    out.emplace_back("adam.m." + params_[i].first, m_[i]);
    out.emplace_back("adam.v." + params_[i].first, v_[i]);
  }
  return out;
}

void Adam::load_state(const nn::NamedTensors& state) {
  std::map<std::string, Tensor> m(state.begin(), state.end());
  auto it = m.find("adam.step");
  if (it == m.end()) throw std::invalid_argument("optimizer state lacks 'adam.step'");
  step_ = static_cast<int64_t>(it->second.item());
  for (size_t i = 0; i < params_.size(); ++i) {
    const Tensor& p = params_[i].second;
    auto mk = "adam.m." + params_[i].first, vk = "adam.v." + params_[i].first;
    if (!m.count(mk)) continue;
    m_[i] = zeros(p.sizes(), p.options());
    v_[i] = zeros(p.sizes(), p.options());
    m_[i].copy_(lookup(m, mk, p));
    v_[i].copy_(lookup(m, vk, p));
  }
}

}  // namespace leasehold::engine::optim
