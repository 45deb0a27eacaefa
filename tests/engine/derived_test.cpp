// Saved tensors made again in backward from what it keeps anyway
// (derived.h): a norm's output a product saves, any view of it, a recipe
// of the caller's own; what the hooks see; where registrations end.
#include <gtest/gtest.h>

#include <algorithm>
#include <any>
#include <memory>
#include <stdexcept>
#include <vector>

#include "agent/engine/autograd.h"
#include "agent/engine/derived.h"
#include "agent/engine/ops.h"

namespace leasehold::engine {
namespace {

struct Outcome {
  std::vector<std::vector<float>> grads;  // x, the norm's weight and bias, the product's weight
  bool norm_output_freed = false;         // before backward
};

// layer_norm, then a product of a view of its output, then a loss.
Outcome norm_then_product(bool derive) {
  manual_seed(3);
  Tensor x = randn({2, 3, 8}).set_requires_grad(true);
  Tensor g = randn({8}).set_requires_grad(true), b = randn({8}).set_requires_grad(true);
  Tensor w = randn({4, 8}).set_requires_grad(true);
  Tensor out;
  std::weak_ptr<Storage> normed_memory;
  {
    DeriveSavedGuard guard(derive);
    Tensor y = layer_norm(x, g, b);
    normed_memory = y.impl()->storage;
    out = linear(y.reshape({6, 8}), w, Tensor());  // (saves the view)
  }
  Outcome r;
  r.norm_output_freed = normed_memory.expired();
  sum(mul(out, out)).backward();
  for (const Tensor& t : {x, g, b, w}) r.grads.push_back(t.grad().to_vector<float>());
  return r;
}

// Inside the guard the product keeps the norm's recipe, not its output:
// the output's memory is gone before backward, which makes it again, and
// every gradient is the plain graph's bit for bit.
TEST(Derived, ANormOutputThatAProductSavesIsMadeAgainInBackward) {
  const Outcome kept = norm_then_product(false);
  const Outcome derived = norm_then_product(true);
  EXPECT_FALSE(kept.norm_output_freed) << "without the guard the product keeps it";
  EXPECT_TRUE(derived.norm_output_freed);
  EXPECT_EQ(derived.grads, kept.grads);
  EXPECT_FALSE(deriving_saved()) << "the guard outlived its scope";
}

// A recipe of the caller's own runs once for each saved tensor that
// backward reads (mul saves both of its inputs), and one that gives
// another shape than the first time is an error naming it, not a wrong
// gradient.
TEST(Derived, ARecipeRunsForEachReadAndMustGiveWhatWasMade) {
  Tensor a = from_vector<float>({1, 2, 3}, {3}).set_requires_grad(true);
  int runs = 0;
  Tensor out;
  {
    DeriveSavedGuard guard(true);
    Tensor t = add(a, a);
    derive_when_saved(
        t,
        [&runs](const std::vector<Tensor>& from) {
          ++runs;
          return add(from[0], from[0]);
        },
        {a});
    out = mul(t, t);
  }
  EXPECT_EQ(runs, 0);
  sum(out).backward();
  EXPECT_EQ(runs, 2);
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{8, 16, 24}));  // d(2a)²/da

  Tensor c = from_vector<float>({1, 2, 3, 4}, {4}).set_requires_grad(true);
  {
    DeriveSavedGuard guard(true);
    Tensor t = mul(c, c);
    derive_when_saved(
        t, [](const std::vector<Tensor>& from) { return from[0].reshape({2, 2}).contiguous(); },
        {c});
    out = mul(t, c);
  }
  try {
    sum(out).backward();
    FAIL() << "a recipe of another shape was taken";
  } catch (const std::logic_error& e) {
    EXPECT_NE(std::string(e.what()).find("[2, 2]"), std::string::npos) << e.what();
  }
}

// Records the storages packed through the hooks.
class Packed final : public SavedTensorHooks {
 public:
  std::any pack(const Tensor& t) override {
    storages.push_back(t.impl()->storage.get());
    return t;
  }
  Tensor unpack(const std::any& packed) override { return std::any_cast<Tensor>(packed); }
  std::vector<const Storage*> storages;
};

// The recipe's inputs go through the saved-tensor hooks (the spill
// manager keeps and spills them as any other); the memory made again
// does not, having nothing to keep.
TEST(Derived, TheRecipesInputsGoThroughTheHooksAndTheDerivedMemoryDoesNot) {
  auto hooks = std::make_shared<Packed>();
  SavedTensorHooksGuard installed(hooks);
  Tensor x = randn({4, 8}).set_requires_grad(true);
  Tensor g = ones({8}), b = zeros({8});
  Tensor w = randn({2, 8}).set_requires_grad(true);
  const Storage* normed = nullptr;
  Tensor out;
  {
    DeriveSavedGuard guard(true);
    Tensor y = layer_norm(x, g, b);
    normed = y.impl()->storage.get();
    out = linear(y, w, Tensor());
  }
  auto packed = [&](const Storage* s) {
    return std::count(hooks->storages.begin(), hooks->storages.end(), s);
  };
  EXPECT_EQ(packed(normed), 0);
  EXPECT_GE(packed(x.impl()->storage.get()), 2) << "the norm's own and the recipe's";
  sum(out).backward();
  EXPECT_TRUE(x.grad().defined());
}

// Registrations do nothing outside a guard or grad mode, and are
// forgotten when the guard ends: tensors saved inside a guard later, or
// after it, keep their memory.
TEST(Derived, RegistrationsHoldOnlyInsideTheGuardAndInGradMode) {
  Tensor a = from_vector<float>({1, 2}, {2}).set_requires_grad(true);
  int runs = 0;
  Derive again = [&runs](const std::vector<Tensor>& from) {
    ++runs;
    return mul(from[0], from[0]);
  };
  Tensor outside = mul(a, a);
  derive_when_saved(outside, again, {a});  // no guard
  Tensor forgotten, out;
  {
    DeriveSavedGuard guard(true);
    forgotten = mul(a, a);
    derive_when_saved(forgotten, again, {a});
    Tensor plain;
    {
      NoGradGuard no_grad;
      plain = mul(a.detach(), a.detach());
      derive_when_saved(plain, again, {a});  // no grad mode
    }
    out = add(mul(outside, a), mul(plain, a));  // saved inside the guard
  }
  out = add(out, mul(forgotten, a));  // saved after it
  std::weak_ptr<Storage> memory = forgotten.impl()->storage;
  forgotten = Tensor();
  outside = Tensor();
  EXPECT_FALSE(memory.expired()) << "saved after the guard ended: kept";
  sum(out).backward();
  EXPECT_EQ(runs, 0);
  // 3a² + a² + 3a²: plain's a² is a constant.
  EXPECT_EQ(a.grad().to_vector<float>(), (std::vector<float>{7, 28}));
}

// A view of registered memory at an offset, with strides (a column of a
// matrix), saved by a product: made again, the view reads the same
// elements of the new memory.
TEST(Derived, AViewAtAnOffsetReadsTheSameElementsMadeAgain) {
  int runs = 0;
  auto run = [&runs](bool derive) {
    Tensor a = from_vector<float>({1, 2, 3, 4, 5, 6}, {2, 3}).set_requires_grad(true);
    Tensor out;
    {
      DeriveSavedGuard guard(derive);
      Tensor t = mul(a, a);
      derive_when_saved(
          t,
          [&runs](const std::vector<Tensor>& from) {
            ++runs;
            return mul(from[0], from[0]);
          },
          {a});
      Tensor column = t.narrow(1, 1, 2).transpose(0, 1);  // [2, 2], offset 1
      // (The other factor needs a gradient: then the product saves the view.)
      Tensor other = from_vector<float>({1, 10, 100, 1000}, {2, 2}).set_requires_grad(true);
      out = mul(column, other);
    }
    sum(mul(out, out)).backward();
    return a.grad().to_vector<float>();
  };
  EXPECT_EQ(run(true), run(false));
  EXPECT_EQ(runs, 1) << "the view was saved as made again";
}

// A view registered is refused: a recipe makes a whole tensor.
TEST(Derived, OnlyAWholeContiguousTensorCanBeRegistered) {
  Tensor a = randn({4, 4}).set_requires_grad(true);
  DeriveSavedGuard guard(true);
  Tensor t = mul(a, a);
  EXPECT_THROW(derive_when_saved(t.transpose(0, 1), [](auto& f) { return f[0]; }, {a}),
               std::logic_error);
}

}  // namespace
}  // namespace leasehold::engine
