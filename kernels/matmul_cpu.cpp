#include <cblas.h>

#include "kernels/matmul.h"

namespace leasehold::kernels::cpu {
namespace {
inline void call(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
                 int64_t lda, const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void call(bool ta, bool tb, int64_t m, int64_t n, int64_t k, double alpha, const double* a,
                 int64_t lda, const double* b, int64_t ldb, double beta, double* c, int64_t ldc) {
  cblas_dgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, alpha, a, lda, b, ldb, beta, c, ldc);
}
}  // namespace

template <class T>
void gemm(const GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c) {
  if (s.m == 0 || s.n == 0) return;
  for (int64_t i = 0; i < s.batch; ++i) {
    if (s.k == 0) {
      // BLAS leaves C untouched for k = 0 only when beta is 1; do it here.
      for (int64_t r = 0; r < s.m; ++r)
        for (int64_t col = 0; col < s.n; ++col) {
          T& v = c[i * s.stride_c + r * s.ldc + col];
          v = beta == T(0) ? T(0) : v * beta;
        }
      continue;
    }
    call(s.trans_a, s.trans_b, s.m, s.n, s.k, alpha, a + i * s.stride_a, s.lda,
         b + i * s.stride_b, s.ldb, beta, c + i * s.stride_c, s.ldc);
  }
}

template void gemm<float>(const GemmShape&, float, const float*, const float*, float, float*);
template void gemm<double>(const GemmShape&, double, const double*, const double*, double,
                           double*);

}  // namespace leasehold::kernels::cpu
