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

}  // namespace leasehold::engine
