#include "agent/engine/derived.h"

#include <optional>
#include <stdexcept>
#include <unordered_map>

#include "agent/engine/autocast.h"
#include "agent/engine/autograd.h"

namespace leasehold::engine {

namespace detail {
struct Derivation {
  std::vector<SavedTensor> from;
  Derive derive;
  std::optional<DType> autocast;
  Shape sizes;
  DType dtype;
};
}  // namespace detail

namespace {

struct Registration {
  std::weak_ptr<Storage> storage;  // (the key's address may be another storage's later)
  Derive derive;
  std::vector<Tensor> from;  // until a SavedTensor takes them into `made`
  std::optional<DType> autocast;
  Shape sizes;
  DType dtype;
  std::shared_ptr<detail::Derivation> made;  // shared by every save of the memory
};

thread_local bool t_deriving = false;
thread_local std::unordered_map<const Storage*, Registration> t_registered;

}  // namespace

bool deriving_saved() { return t_deriving; }

DeriveSavedGuard::DeriveSavedGuard(bool on) : previous_(t_deriving) { t_deriving = on; }
DeriveSavedGuard::~DeriveSavedGuard() {
  t_deriving = previous_;
  if (!t_deriving) t_registered.clear();
}

void derive_when_saved(const Tensor& t, Derive derive, std::vector<Tensor> from) {
  if (!t_deriving || !grad_enabled() || !t.defined()) return;
  const auto& storage = t.impl()->storage;
  if (!storage || !t.is_contiguous() || t.storage_offset() != 0 ||
      static_cast<size_t>(t.numel()) * dtype_size(t.dtype()) != storage->bytes()) {
    throw std::logic_error("derive_when_saved: " + t.shape_str() +
                           " is not the whole of its memory as one contiguous tensor");
  }
  Registration r;
  r.storage = storage;
  r.derive = std::move(derive);
  r.from = std::move(from);
  r.autocast = autocast_dtype(t.device());
  r.sizes = t.sizes();
  r.dtype = t.dtype();
  t_registered.insert_or_assign(storage.get(), std::move(r));
}

namespace detail {

std::shared_ptr<const Derivation> derivation_of(const Tensor& t) {
  if (!t_deriving || t_registered.empty() || !t.defined()) return nullptr;
  const auto& storage = t.impl()->storage;
  auto it = t_registered.find(storage.get());
  if (it == t_registered.end()) return nullptr;
  Registration& r = it->second;
  if (r.storage.lock() != storage) {  // a storage since freed at the same address
    t_registered.erase(it);
    return nullptr;
  }
  if (!r.made) {
    auto d = std::make_shared<Derivation>();
    for (const Tensor& f : r.from) d->from.emplace_back(f);
    d->derive = std::move(r.derive);
    d->autocast = r.autocast;
    d->sizes = r.sizes;
    d->dtype = r.dtype;
    r.from.clear();
    r.made = std::move(d);
  }
  return r.made;
}

Tensor derive(const Derivation& d) {
  std::vector<Tensor> from;
  from.reserve(d.from.size());
  for (const SavedTensor& s : d.from) from.push_back(s.get());
  Tensor out;
  {
    NoGradGuard no_grad;
    AutocastGuard autocast(d.autocast);
    OutputsUnreadGuard read(false);  // (backward reads it)
    out = d.derive(from);
  }
  if (!out.defined() || out.sizes() != d.sizes || out.dtype() != d.dtype || !out.is_contiguous() ||
      out.storage_offset() != 0) {
    throw std::logic_error("a tensor made again for backward came out " +
                           (out.defined() ? out.shape_str() + " " + dtype_name(out.dtype())
                                          : std::string("undefined")) +
                           ", not as it was first made");
  }
  return out;
}

}  // namespace detail
}  // namespace leasehold::engine
