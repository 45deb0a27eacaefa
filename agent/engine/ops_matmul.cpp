// matmul: products of 2-D and batched 3-D tensors (gemm.h), and their
// backward.
#include <stdexcept>

#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/gemm.h"
#include "agent/engine/ops.h"

namespace leasehold::engine {
namespace {

using detail::gemm;

// Forward and backward both reduce to: 3-D batched x (3-D or shared 2-D).
struct MatmulBackward final : Node {
  SavedTensor a, b;  // contiguous
  const char* name() const override { return "MatmulBackward"; }
  std::vector<Tensor> apply(const Tensor& g_in) override {
    Tensor A = a.get(), B = b.get(), g = g_in.contiguous();
    Tensor ga, gb;
    bool batched = A.dim() == 3;
    int64_t batch = batched ? A.size(0) : 1;
    int64_t m = A.size(-2), k = A.size(-1), n = B.size(-1);
    bool b_batched = B.dim() == 3;
    if (next[0].fn) {
      // dA = dC · Bᵀ
      ga = gemm(g, false, B, true, batch, m, k, n, true, b_batched, A.sizes());
    }
    if (next[1].fn) {
      if (b_batched || !batched) {
        // dB = Aᵀ · dC, per batch
        gb = gemm(A, true, g, false, batch, k, n, m, true, true, B.sizes());
      } else {
        // B shared across the batch: dB = sum_b Aᵀ_b dC_b = (A as [b*m, k])ᵀ · (dC as [b*m, n])
        gb = gemm(A, true, g, false, 1, k, n, batch * m, false, false, B.sizes());
      }
    }
    return {ga, gb};
  }
  void release_saved() override { a.reset(); b.reset(); }
};

}  // namespace

Tensor matmul(const Tensor& a_in, const Tensor& b_in) {
  detail::check_same(a_in, b_in, "matmul");
  bool ok = (a_in.dim() == 2 && b_in.dim() == 2) || (a_in.dim() == 3 && b_in.dim() == 3) ||
            (a_in.dim() == 3 && b_in.dim() == 2);
  if (!ok || a_in.size(-1) != b_in.size(-2) ||
      (a_in.dim() == 3 && b_in.dim() == 3 && a_in.size(0) != b_in.size(0))) {
    throw std::invalid_argument("matmul: cannot multiply " + a_in.shape_str() + " by " +
                                b_in.shape_str());
  }
  Tensor a, b;
  {
    NoGradGuard no_grad;
    a = a_in.contiguous();
    b = b_in.contiguous();
  }
  bool batched = a.dim() == 3;
  int64_t batch = batched ? a.size(0) : 1;
  int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  Shape out_shape = batched ? Shape{batch, m, n} : Shape{m, n};
  Tensor out = gemm(a, false, b, false, batch, m, n, k, true, b.dim() == 3, out_shape);
  if (any_requires_grad({&a_in, &b_in})) {
    auto node = std::make_shared<MatmulBackward>();
    node->a = SavedTensor(a);
    node->b = SavedTensor(b);
    record(out, node, {&a_in, &b_in});
  }
  return out;
}

}  // namespace leasehold::engine
