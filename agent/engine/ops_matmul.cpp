// Matrix products through OpenBLAS (CPU) and cuBLAS (CUDA).
#include <stdexcept>

#include "agent/engine/autograd.h"
#include "agent/engine/dispatch.h"
#include "agent/engine/ops.h"
#include "kernels/matmul.h"

namespace leasehold::engine {
namespace {

// C = op(A) op(B) for contiguous row-major operands, batched when batch > 1.
// A batch stride of 0 reuses one matrix across the batch.
Tensor gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, int64_t batch, int64_t m,
            int64_t n, int64_t k, bool a_batched, bool b_batched, Shape out_shape) {
  Tensor out = empty(out_shape, a.options());
  kernels::GemmShape s;
  s.trans_a = ta;
  s.trans_b = tb;
  s.m = m;
  s.n = n;
  s.k = k;
  s.lda = ta ? m : k;
  s.ldb = tb ? k : n;
  s.ldc = n;
  s.batch = batch;
  s.stride_a = a_batched ? m * k : 0;
  s.stride_b = b_batched ? k * n : 0;
  s.stride_c = m * n;
  detail::dispatch_floating(a.dtype(), "matmul", [&](auto tag) {
    using T = decltype(tag);
    if (a.device().is_cuda()) {
      LEASEHOLD_CUDA_OR("matmul", kernels::cuda::gemm<T>(cublas_handle(a.device().index), s, T(1),
                                                         a.data<T>(), b.data<T>(), T(0),
                                                         out.data<T>(), allow_tf32()));
    } else {
      kernels::cpu::gemm<T>(s, T(1), a.data<T>(), b.data<T>(), T(0), out.data<T>());
    }
  });
  return out;
}

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
