#include "tests/engine/gradcheck.h"

#include <cmath>
#include <sstream>

#include "agent/engine/autograd.h"
#include "agent/engine/ops.h"

namespace leasehold::engine::testing {

std::string gradcheck(const Fn& f, std::vector<Tensor> inputs, double eps, double tol) {
  for (auto& x : inputs) x = x.detach().contiguous().clone().detach().set_requires_grad(true);
  Tensor out = f(inputs);
  Tensor r = randn(out.sizes(), {DType::Float64});
  Tensor loss = sum(mul(out, r));
  loss.backward();
  for (size_t i = 0; i < inputs.size(); ++i) {
    Tensor analytic = inputs[i].grad();
    std::vector<double> a = analytic.defined() ? analytic.to_vector<double>()
                                               : std::vector<double>(inputs[i].numel(), 0.0);
    double* x = inputs[i].data<double>();
    for (int64_t j = 0; j < inputs[i].numel(); ++j) {
      double keep = x[j];
      NoGradGuard no_grad;
      x[j] = keep + eps;
      double up = sum(mul(f(inputs), r)).item();
      x[j] = keep - eps;
      double down = sum(mul(f(inputs), r)).item();
      x[j] = keep;
      double numeric = (up - down) / (2 * eps);
      if (std::abs(a[j] - numeric) > tol * std::max(1.0, std::abs(numeric))) {
        std::ostringstream os;
        os << "input " << i << " element " << j << ": backward " << a[j] << ", numeric "
           << numeric;
        return os.str();
      }
    }
  }
  return "";
}

double max_rel_diff(const Tensor& a, const Tensor& b) {
  auto va = a.to(DType::Float64).to_vector<double>();
  auto vb = b.to(DType::Float64).to_vector<double>();
  if (va.size() != vb.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < va.size(); ++i) {
    double d = std::abs(va[i] - vb[i]) / std::max(1.0, std::abs(vb[i]));
    if (std::isnan(d)) return INFINITY;
    worst = std::max(worst, d);
  }
  return worst;
}

}  // namespace leasehold::engine::testing
