// Row-major GEMM: C = alpha * op(A) * op(B) + beta * C, where op(X) is X or
// its transpose. A is [m, k] after op, B [k, n], C [m, n]; lda/ldb/ldc are
// row strides. Batched: `batch` products with element strides between them
// (a stride of 0 reuses one matrix for every product).
// CPU through OpenBLAS; CUDA through cuBLAS on the given handle's stream.
#pragma once

#include <cstdint>

#include "kernels/bfloat16.h"

#ifdef LEASEHOLD_HAVE_CUDA
#include <cublas_v2.h>
#endif

namespace leasehold::kernels {

struct GemmShape {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  int64_t batch = 1;
  int64_t stride_a = 0, stride_b = 0, stride_c = 0;
};

namespace cpu {
template <class T>
void gemm(const GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c);
}

#ifdef LEASEHOLD_HAVE_CUDA
namespace cuda {
// `tf32`: allow TF32 tensor-core math for float (off gives full FP32).
template <class T>
void gemm(cublasHandle_t handle, const GemmShape& s, T alpha, const T* a, const T* b, T beta,
          T* c, bool tf32);
// Mixed precision: bfloat16 A and B on tensor cores, float32 accumulation
// and C (one product: s.batch must be 1).
void gemm_bf16(cublasHandle_t handle, const GemmShape& s, float alpha, const bfloat16* a,
               const bfloat16* b, float beta, float* c);
}
#endif

}  // namespace leasehold::kernels
