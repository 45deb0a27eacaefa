#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/matmul.h"

namespace leasehold::kernels::cuda {
namespace {

void check(cublasStatus_t st, const char* what) {
  if (st != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + " failed: " + cublasGetStatusName(st) + " (" +
                             cublasGetStatusString(st) + ")");
  }
}

template <class T>
struct Traits;
template <>
struct Traits<float> {
  static constexpr cudaDataType_t type = CUDA_R_32F;
};
template <>
struct Traits<double> {
  static constexpr cudaDataType_t type = CUDA_R_64F;
};

}  // namespace

// cuBLAS is column-major. A row-major C[m,n] = A[m,k] B[k,n] is the
// column-major C^T[n,m] = B^T[n,k] A^T[k,m]: swap the operands and m/n, keep
// the leading dimensions and transpose flags as they are.
template <class T>
void gemm(cublasHandle_t handle, const GemmShape& s, T alpha, const T* a, const T* b, T beta,
          T* c, bool tf32) {
  if (s.m == 0 || s.n == 0) return;
  cublasComputeType_t compute = CUBLAS_COMPUTE_64F;
  if constexpr (std::is_same_v<T, float>) {
    compute = tf32 ? CUBLAS_COMPUTE_32F_FAST_TF32 : CUBLAS_COMPUTE_32F;
  }
  cublasOperation_t opb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasOperation_t opa = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (s.batch == 1) {
    // The plain entry point: its heuristics can pick faster kernels than the
    // batched one does for a single product (seen with TF32 at n = 4096).
    check(cublasGemmEx(handle, opb, opa, s.n, s.m, s.k, &alpha, b, Traits<T>::type, s.ldb, a,
                       Traits<T>::type, s.lda, &beta, c, Traits<T>::type, s.ldc, compute,
                       CUBLAS_GEMM_DEFAULT),
          "cublasGemmEx");
    return;
  }
  check(cublasGemmStridedBatchedEx(handle, opb, opa, s.n, s.m, s.k, &alpha, b, Traits<T>::type,
                                   s.ldb, s.stride_b, a, Traits<T>::type, s.lda, s.stride_a,
                                   &beta, c, Traits<T>::type, s.ldc, s.stride_c, s.batch, compute,
                                   CUBLAS_GEMM_DEFAULT),
        "cublasGemmStridedBatchedEx");
}

template void gemm<float>(cublasHandle_t, const GemmShape&, float, const float*, const float*,
                          float, float*, bool);
template void gemm<double>(cublasHandle_t, const GemmShape&, double, const double*,
                           const double*, double, double*, bool);

}  // namespace leasehold::kernels::cuda
