#include "agent/engine/autocast.h"

#include <algorithm>
#include <exception>
#include <stdexcept>

#include <spdlog/spdlog.h>

#include "agent/engine/autograd.h"
#include "agent/engine/kernel_table.h"
#include "kernels/elementwise.h"

namespace leasehold::engine {
namespace {
thread_local std::optional<DType> t_autocast;
thread_local AutocastWeights* t_weights = nullptr;  // the innermost scope
thread_local uint64_t t_passes = 0;

const KernelTable<decltype(kernels::cpu::convert_bf16_copies)> kConvertCopies{
    "autocast_weights",
    {&kernels::cpu::convert_bf16_copies,
     LEASEHOLD_CUDA_KERNEL(kernels::cuda::convert_bf16_copies)}};

// The same tensor: the same elements of the same storage, in the same shape.
bool same_tensor(const Tensor& a, const Tensor& b) {
  return a.impl()->storage == b.impl()->storage && a.storage_offset() == b.storage_offset() &&
         a.sizes() == b.sizes() && a.strides() == b.strides();
}
}  // namespace

AutocastGuard::AutocastGuard(std::optional<DType> dtype) : previous_(t_autocast) {
  if (dtype && *dtype != DType::BFloat16) {
    throw std::invalid_argument(std::string("autocast: ") + dtype_name(*dtype) +
                                " is not a lower precision (bfloat16 is)");
  }
  t_autocast = dtype;
}

AutocastGuard::~AutocastGuard() { t_autocast = previous_; }

std::optional<DType> autocast_dtype(Device device) {
  return device.is_cuda() ? t_autocast : std::nullopt;
}

AutocastWeights::AutocastWeights(const std::vector<Tensor>& params,
                                 std::vector<std::pair<Tensor, Tensor>> made)
    : copies_(std::move(made)), outer_(t_weights) {
  NoGradGuard no_grad;
  const size_t handed = copies_.size();
  std::vector<Tensor> wanted;
  for (const Tensor& p : params) {
    if (!p.defined() || p.dtype() != DType::Float32 ||
        autocast_dtype(p.device()) != DType::BFloat16 || !p.is_contiguous() || p.numel() == 0) {
      continue;
    }
    const bool seen = std::any_of(wanted.begin(), wanted.end(),
                                  [&](const Tensor& w) { return same_tensor(w, p); });
    const bool had = std::any_of(copies_.begin(), copies_.end(),
                                 [&](const auto& c) { return same_tensor(c.first, p); });
    if (!seen && !had && !(outer_ && outer_->find(p))) wanted.push_back(p);
  }
  for (const Tensor& p : wanted) {
    copies_.emplace_back(p, empty(p.sizes(), {DType::BFloat16, p.device()}));
  }
  if (!wanted.empty()) ++t_passes;
  // One launch per kMaxConvertTensors copies on one device.
  for (size_t first = handed; first < copies_.size();) {
    const Device device = copies_[first].first.device();
    kernels::Bf16Copies batch;
    int64_t total = 0;
    size_t k = first;
    for (; k < copies_.size() && batch.count < kernels::kMaxConvertTensors &&
           copies_[k].first.device() == device;
         ++k) {
      batch.in[batch.count] = copies_[k].first.data<float>();
      batch.out[batch.count] = copies_[k].second.data<bfloat16>();
      total += copies_[k].first.numel();
      batch.end[batch.count++] = total;
    }
    kConvertCopies.run(device, batch);
    first = k;
  }
  t_weights = this;
}

AutocastWeights::~AutocastWeights() {
  if (t_weights != this) {
    // (The scope outside it would be restored after its own end: every
    // later lookup on this thread would read a dead scope.)
    spdlog::critical("AutocastWeights: scopes ended out of order on one thread");
    std::terminate();
  }
  t_weights = outer_;
}

void AutocastWeights::release(const std::vector<Tensor>& params) {
  for (AutocastWeights* s = this; s != nullptr; s = s->outer_) {
    std::erase_if(s->copies_, [&](const std::pair<Tensor, Tensor>& c) {
      return std::any_of(params.begin(), params.end(),
                         [&](const Tensor& p) { return same_tensor(c.first, p); });
    });
  }
}

AutocastWeights* autocast_weights() { return t_weights; }

uint64_t AutocastWeights::passes_on_this_thread() { return t_passes; }

std::vector<std::pair<Tensor, Tensor>> AutocastWeights::copies_of(
    const std::vector<Tensor>& params) const {
  std::vector<std::pair<Tensor, Tensor>> out;
  for (const Tensor& p : params) {
    const bool seen = std::any_of(out.begin(), out.end(),
                                  [&](const auto& c) { return same_tensor(c.first, p); });
    if (const Tensor* copy = find(p); copy && !seen) out.emplace_back(p, *copy);
  }
  return out;
}

const Tensor* AutocastWeights::find(const Tensor& t) const {
  for (const AutocastWeights* s = this; s != nullptr; s = s->outer_) {
    for (const auto& [param, copy] : s->copies_) {
      if (same_tensor(param, t)) return &copy;
    }
  }
  return nullptr;
}

Tensor autocast_copy(const Tensor& t) {
  if (t.dtype() == DType::Float32 && t_weights != nullptr) {
    if (const Tensor* copy = t_weights->find(t)) return *copy;
  }
  NoGradGuard no_grad;
  return t.to(DType::BFloat16);
}

}  // namespace leasehold::engine
