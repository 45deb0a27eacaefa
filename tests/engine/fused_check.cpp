#include "tests/engine/fused_check.h"

#include <vector>

#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"

namespace leasehold::engine {

namespace {

struct Result {
  std::vector<float> out, g_residual, g_x;
};

Result run(Device device, int64_t n, double p, bool training, bool fused) {
  manual_seed(23);
  Tensor residual = randn({n}).to(device).set_requires_grad(true);
  Tensor x = randn({n}).to(device).set_requires_grad(true);
  Tensor w = randn({n}).to(device);
  manual_seed(77);  // the mask's draw
  Tensor out = fused ? add_dropout(residual, x, p, training)
                     : add(residual, dropout(x, p, training));
  sum(mul(out, w)).backward();
  return {out.detach().to(Device::cpu()).to_vector<float>(),
          residual.grad().to(Device::cpu()).to_vector<float>(),
          x.grad().to(Device::cpu()).to_vector<float>()};
}

}  // namespace

std::string add_dropout_mismatch(Device device) {
  for (int64_t n : {1025, 4096}) {
    for (double p : {0.3, 0.0}) {
      for (bool training : {true, false}) {
        const std::string what = "n " + std::to_string(n) + ", p " + std::to_string(p) +
                                 (training ? ", training" : ", not training") + ": ";
        const Result two = run(device, n, p, training, false);
        const Result one = run(device, n, p, training, true);
        if (one.out != two.out) return what + "the output differs";
        if (one.g_residual != two.g_residual) return what + "the residual's gradient differs";
        if (one.g_x != two.g_x) return what + "the input's gradient differs";
      }
    }
  }
  return "";
}

}  // namespace leasehold::engine
