#include "tests/engine/fused_check.h"

#include <vector>

#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"

namespace leasehold::engine {

namespace {

struct Result {
  std::vector<double> out, g_residual, g_x;
};

std::vector<double> values(const Tensor& t) {
  return t.detach().to(Device::cpu()).to(DType::Float64).to_vector<double>();
}

// `shifted`: the residual a view one element into a longer tensor (not
// 16-byte aligned: the kernel's one-element path). `frozen`: x needs no
// gradient.
Result run(Device device, DType dtype, int64_t n, double p, bool training, bool shifted,
           bool frozen, bool fused) {
  manual_seed(23);
  const Tensor base = randn({n + 1}).to(dtype).to(device);
  Tensor residual = base.narrow(0, shifted ? 1 : 0, n).detach().set_requires_grad(true);
  Tensor x = randn({n}).to(dtype).to(device).set_requires_grad(!frozen);
  Tensor w = randn({n}).to(dtype).to(device);
  manual_seed(77);  // the mask's draw
  Tensor out = fused ? add_dropout(residual, x, p, training)
                     : add(residual, dropout(x, p, training));
  sum(mul(out, w)).backward();
  return {values(out), values(residual.grad()), frozen ? std::vector<double>{} : values(x.grad())};
}

}  // namespace

std::string add_dropout_mismatch(Device device) {
  for (DType dtype : {DType::Float32, DType::Float64}) {
    for (int64_t n : {1025, 4096}) {
      for (bool shifted : {false, true}) {
        for (double p : {0.3, 0.0}) {
          for (bool training : {true, false}) {
            for (bool frozen : {false, true}) {
              const std::string what =
                  std::string(dtype == DType::Float32 ? "float32" : "float64") + ", n " +
                  std::to_string(n) + (shifted ? ", residual one element in" : "") + ", p " +
                  std::to_string(p) + (training ? ", training" : ", not training") +
                  (frozen ? ", x frozen" : "") + ": ";
              const Result two = run(device, dtype, n, p, training, shifted, frozen, false);
              const Result one = run(device, dtype, n, p, training, shifted, frozen, true);
              if (one.out != two.out) return what + "the output differs";
              if (one.g_residual != two.g_residual) return what + "the residual's gradient differs";
              if (one.g_x != two.g_x) return what + "the input's gradient differs";
            }
          }
        }
      }
    }
  }
  return "";
}

std::string layer_norm_fold_mismatch(Device device) {
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {37, 30}, {300, 384}, {5, 1100}, {3000, 64}};
  for (DType dtype : {DType::Float32, DType::Float64}) {
    for (auto [rows, cols] : shapes) {
      const std::string what = std::string(dtype == DType::Float32 ? "float32" : "float64") +
                               ", " + std::to_string(rows) + " x " + std::to_string(cols) + ": ";
      manual_seed(29);
      const Tensor x = randn({rows, cols}).to(dtype).to(device);
      const Tensor w = randn({cols}).to(dtype).to(device), b = randn({cols}).to(dtype).to(device);
      const Tensor g = randn({rows, cols}).to(dtype).to(device);
      auto leaf = [](const Tensor& t) { return t.detach().set_requires_grad(true); };
      // Folded: x's two gradients meet in layer norm's backward.
      Tensor x1 = leaf(x), w1 = leaf(w), b1 = leaf(b);
      add(x1, layer_norm(x1, w1, b1)).backward(g);
      // Apart: layer norm's own, then the residual's added after.
      Tensor x2 = leaf(x), w2 = leaf(w), b2 = leaf(b);
      layer_norm(x2, w2, b2).backward(g);
      if (values(x1.grad()) != values(add(g, x2.grad()))) return what + "x's gradient differs";
      if (values(w1.grad()) != values(w2.grad())) return what + "the weight's gradient differs";
      if (values(b1.grad()) != values(b2.grad())) return what + "the bias's gradient differs";
    }
  }
  return "";
}

}  // namespace leasehold::engine
