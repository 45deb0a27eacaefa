#include <stdexcept>
#include <string>
#include <type_traits>

#include "kernels/matmul.h"
#include "shared/cuda_check.h"

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

// Products with few outputs and a short inner dimension skip cuBLAS: its
// heuristics were seen to pick split-K kernels several times slower than
// the arithmetic for them (an H100: 31 µs for a [10, 84] weight gradient
// over a batch of 128), and a split-K product is two kernels in a step's
// chain. So do products of up to 16,384 outputs (a batch of 128 by 128
// features) and 2M multiply-adds, an inner dimension up to 1024 as well:
// on an H200 under ncu, LeNet's [128, 84] and [128, 120] products (1.3M
// each) took cuBLAS 8.8-12.6 µs in two kernels (a SIMT product and its
// split-K reduction) and take this one 4.2-8.8 µs; LeNet's first layer's
// forward (6.1M) took this one 19 µs against cuBLAS's 13.8, and the MLP
// job's second layer (4.2M) cost its eight jobs 3% of their throughput
// here. kSmallLanes neighbouring threads share an output, each taking
// every kSmallLanes-th step of the inner dimension with four loads in
// flight, and add up with shuffles (a fixed order: deterministic).
constexpr int64_t kSmallOutputs = 4096, kSmallDepth = 1024;
constexpr int64_t kSmallWideOutputs = 16384, kSmallWideWork = int64_t{1} << 21;
constexpr int kSmallLanes = 4, kSmallBlock = 128;

template <class T, bool kTransA, bool kTransB>
__global__ void gemm_small_kernel(GemmShape s, T alpha, const T* __restrict__ a,
                                  const T* __restrict__ b, T beta, T* __restrict__ c) {
  const int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int64_t idx = t / kSmallLanes;
  const int lane = int(t % kSmallLanes);
  const bool valid = idx < s.m * s.n;
  const int64_t i = valid ? idx / s.n : 0, j = valid ? idx % s.n : 0;
  auto at = [&](int64_t p) {
    const T av = kTransA ? a[p * s.lda + i] : a[i * s.lda + p];
    const T bv = kTransB ? b[j * s.ldb + p] : b[p * s.ldb + j];
    return av * bv;
  };
  T acc[4] = {0, 0, 0, 0};
  const int64_t k = valid ? s.k : 0;
  int64_t p = lane;
  for (; p + 3 * kSmallLanes < k; p += 4 * kSmallLanes) {
#pragma unroll
    for (int u = 0; u < 4; ++u) acc[u] += at(p + u * kSmallLanes);
  }
  for (; p < k; p += kSmallLanes) acc[0] += at(p);
  T sum = (acc[0] + acc[1]) + (acc[2] + acc[3]);
#pragma unroll
  for (int off = kSmallLanes / 2; off > 0; off /= 2) sum += __shfl_xor_sync(~0u, sum, off);
  if (!valid || lane != 0) return;
  T* out = c + i * s.ldc + j;
  *out = beta == T(0) ? alpha * sum : alpha * sum + beta * *out;  // C unread when beta = 0
}

template <class T>
void gemm_small(const GemmShape& s, T alpha, const T* a, const T* b, T beta, T* c,
                cudaStream_t stream) {
  const int64_t threads = s.m * s.n * kSmallLanes;
  const unsigned grid = unsigned((threads + kSmallBlock - 1) / kSmallBlock);
  if (s.trans_a && s.trans_b) {
    gemm_small_kernel<T, true, true><<<grid, kSmallBlock, 0, stream>>>(s, alpha, a, b, beta, c);
  } else if (s.trans_a) {
    gemm_small_kernel<T, true, false><<<grid, kSmallBlock, 0, stream>>>(s, alpha, a, b, beta, c);
  } else if (s.trans_b) {
    gemm_small_kernel<T, false, true><<<grid, kSmallBlock, 0, stream>>>(s, alpha, a, b, beta, c);
  } else {
    gemm_small_kernel<T, false, false><<<grid, kSmallBlock, 0, stream>>>(s, alpha, a, b, beta, c);
  }
  LEASEHOLD_CUDA_CHECK(cudaGetLastError());
}

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
  const int64_t outputs = s.m * s.n;
  if (s.batch == 1 && s.k <= kSmallDepth &&
      (outputs <= kSmallOutputs ||
       (outputs <= kSmallWideOutputs && outputs * s.k <= kSmallWideWork))) {
    cudaStream_t stream = nullptr;
    check(cublasGetStream(handle, &stream), "cublasGetStream");
    gemm_small(s, alpha, a, b, beta, c, stream);
    return;
  }
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

void gemm_bf16(cublasHandle_t handle, const GemmShape& s, float alpha, const bfloat16* a,
               const bfloat16* b, float beta, void* c, GemmOut out) {
  if (s.batch != 1) throw std::invalid_argument("gemm_bf16: one product at a time");
  if (s.m == 0 || s.n == 0) return;
  const cublasOperation_t opb = s.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opa = s.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cudaDataType_t c_type = out == GemmOut::BFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  check(cublasGemmEx(handle, opb, opa, s.n, s.m, s.k, &alpha, b, CUDA_R_16BF, s.ldb, a,
                     CUDA_R_16BF, s.lda, &beta, c, c_type, s.ldc, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx (bfloat16)");
}

template void gemm<float>(cublasHandle_t, const GemmShape&, float, const float*, const float*,
                          float, float*, bool);
template void gemm<double>(cublasHandle_t, const GemmShape&, double, const double*,
                           const double*, double, double*, bool);

}  // namespace leasehold::kernels::cuda
